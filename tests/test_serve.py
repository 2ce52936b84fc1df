"""`moechat serve`: a real server on a loopback port, real clients (the official `openai` client, httpx).

One server per module (loading costs seconds): a small MoE written by the suite, an expert cache on,
a short context so that a prompt can outgrow it. Every bad request is checked to leave the server
answering the next good one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from testkit.ggufgen import QWEN_TEMPLATE, tiny_moe, tiny_moe_parts, write_gguf

MOECHAT = [sys.executable, "-m", "moechat"]
N_CTX = 96
FLAGS = ["--temp", "0", "-c", str(N_CTX), "--moe-cache-mib", "0.4", "--moe-cache-cpu-share", "0.5", "-t", "1"]
KEY = "sekret-key"


class Server:
    def __init__(self, model: Path, *extra: str) -> None:
        env = {**os.environ, "MOECHAT_COMPILE_AHEAD": "0"}
        self.proc = subprocess.Popen([*MOECHAT, "serve", str(model), "--port", "0", *FLAGS, *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        assert self.proc.stderr is not None
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"serving .* on (http://[\d.]+:\d+)/v1", line)
            if m:
                self.url = m.group(1)
                break
        else:
            self.stop()
            pytest.fail("the server did not start: " + "".join(lines))
        if not hasattr(self, "url"):
            self.stop()
            pytest.fail("the server ended: " + "".join(lines))
        self.head = "".join(lines)  # what it said up to serving
        # Keep reading its stderr, so that its log lines never fill the pipe.
        self.log: list[str] = []
        err = self.proc.stderr
        threading.Thread(target=lambda: self.log.extend(iter(err.readline, "")), daemon=True).start()

    def rss_kib(self) -> int:
        return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{self.proc.pid}/status").read_text())[1])  # type: ignore[index]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("serve") / "m.gguf", n_layers=3, n_vocab=300)


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    s = Server(model)
    yield s
    s.stop()


def _openai(server: Server, key: str = "none") -> object:
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _run_chat(model: Path, prompt: str, n: int, *flags: str) -> tuple[str, int]:
    """`moechat run --chat`'s text and prompt tokens, the reference a server must equal."""
    r = subprocess.run([*MOECHAT, "run", str(model), "--chat", "-p", prompt, "-n", str(n), *FLAGS, *flags],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    m = re.search(r"prompt: (\d+) tokens", r.stderr)
    assert m is not None, r.stderr
    return r.stdout.removesuffix("\n"), int(m[1])


def test_the_openai_client_gets_what_run_writes_streamed_or_not(server: Server, model: Path) -> None:
    client = _openai(server)
    want, n_prompt = _run_chat(model, "Tell me about rivers.", 12)
    whole = client.chat.completions.create(  # type: ignore[attr-defined]
        model="m.gguf", messages=[{"role": "user", "content": "Tell me about rivers."}], max_tokens=12, temperature=0
    )
    assert whole.choices[0].message.content == want and whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.prompt_tokens == n_prompt and whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == n_prompt + whole.usage.completion_tokens
    stream = client.chat.completions.create(  # type: ignore[attr-defined]
        model="m.gguf", messages=[{"role": "user", "content": "Tell me about rivers."}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True})  # fmt: skip
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == want and finish == whole.choices[0].finish_reason
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (
        n_prompt,
        whole.usage.completion_tokens,
    )
    # A raw prompt: `moechat run --raw`'s text.
    r = subprocess.run([*MOECHAT, "run", str(model), "--raw", "-p", "Once upon a time", "-n", "8", *FLAGS],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    text = client.completions.create(model="m.gguf", prompt="Once upon a time", max_tokens=8,  # type: ignore[attr-defined]
                                     temperature=0).choices[0].text  # fmt: skip
    assert text == r.stdout.removesuffix("\n")
    assert [m.id for m in client.models.list()] == ["m.gguf"]  # type: ignore[attr-defined]


def test_stop_sequences_stop(server: Server) -> None:
    client = _openai(server)
    ask = {"model": "m.gguf", "messages": [{"role": "user", "content": "Say something."}], "temperature": 0}
    full = client.chat.completions.create(max_tokens=16, **ask).choices[0].message.content  # type: ignore[attr-defined]
    found = re.search(r"[A-Za-z]{2}", full[2:])  # printable text to stop at, past the first characters
    assert found is not None, full
    stop = found.group(0)
    cut = client.chat.completions.create(max_tokens=16, stop=[stop], **ask).choices[0]  # type: ignore[attr-defined]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "m.gguf"}', 400, "'messages' is required"),
        (b'{"messages": "hi"}', 400, "'messages' must be an array"),
        (b'{"messages": []}', 400, "at least one message"),
        (b'{"messages": [{"role": "user", "content": 5}]}', 400, "content' must be a string"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}', 400, "'max_tokens' must be"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "at least 1"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": true}', 400, "not a boolean"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "'n' other than 1"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', 400, "tools"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}', 400, "logprobs"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}', 404, "does not exist"),
        (b'{"messages": [{"role": "user", "content": "' + b"word " * 400 + b'"}]}', 400, "context holds"),
        (b'{"messages": [{"role": "user", "content": "' + b"x" * (9 * 2**20) + b'"}]}', 413, "over 8 MiB"),
    ],
)
def test_bad_requests_get_their_status_and_an_openai_error_and_the_next_is_answered(
    server: Server, body: bytes, status: int, says: str
) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)  # fmt: skip
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}
    good = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 2}, timeout=60)  # fmt: skip
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"]


def test_more_tokens_than_the_context_end_at_the_context_and_a_wrong_method_is_405(server: Server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 100000,
                                                         "temperature": 0}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    use = r.json()["usage"]
    assert use["prompt_tokens"] + use["completion_tokens"] <= N_CTX and r.json()["choices"][0]["finish_reason"]
    wrong = httpx.get(server.url + "/v1/chat/completions", timeout=30)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(server.url + "/v1/nothing", timeout=30).status_code == 404


def test_metrics_parse_and_their_cache_counters_are_the_engines(server: Server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                          "max_tokens": 6}, timeout=60)  # fmt: skip
    text = httpx.get(server.url + "/metrics", timeout=30).text
    snap = httpx.get(server.url + "/moechat/stats", timeout=30).json()["snapshot"]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, s.labels.get("group")): s.value for f in families.values() for s in f.samples}
    assert samples[("moechat_completion_tokens_total", None)] >= 6
    assert snap is not None and snap["groups"]
    for g in snap["groups"]:
        layers = [la for la in snap["layers"] if la["group"] == g["index"]]
        hits = sum(la["small"]["hits"] + la["large"]["hits"] for la in layers)
        misses = sum(la["small"]["misses"] + la["large"]["misses"] for la in layers)
        cpu = sum(la["small"]["cpu"] + la["large"]["cpu"] for la in layers)
        assert samples[("moechat_cache_hits_total", str(g["index"]))] == hits > 0
        assert samples[("moechat_cache_misses_total", str(g["index"]))] == misses
        assert samples[("moechat_cache_cpu_misses_total", str(g["index"]))] == cpu
        assert samples[("moechat_cache_slots", str(g["index"]))] == g["n_slots"]
        for name in ("prefetch_hits", "prefetched", "predicted", "predicted_used"):  # look-ahead's counters
            want = sum(la["small"][name] + la["large"][name] for la in layers)
            assert samples[(f"moechat_cache_{name}_total", str(g["index"]))] == want, name


def test_a_server_on_the_ram_tier_answers_the_same_and_counts_its_reads(model: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    want, _ = _run_chat(model, "Tell me about rivers.", 8, "--moe-cache-mib", "0")
    s = Server(model, "--ram-cache-mib", "1", "--moe-cache-mib", "0")
    try:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content":
                       "Tell me about rivers."}], "max_tokens": 8, "temperature": 0}, timeout=120)  # fmt: skip
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
        text = httpx.get(s.url + "/metrics", timeout=30).text
        ram = httpx.get(s.url + "/moechat/stats", timeout=30).json()["snapshot"]["ram"]
    finally:
        s.stop()
    samples = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}
    assert samples["moechat_ram_tier_reads_total"] == ram["reads"] > 0
    assert samples["moechat_ram_tier_lookups_total"] == ram["lookups"] == ram["hits"] + ram["reads"]
    assert samples["moechat_ram_tier_read_bytes_total"] == ram["bytes_read"] > 0
    assert 0 < samples["moechat_ram_tier_slots"] == ram["n_slots"] < ram["n_expert_total"]


@pytest.mark.slow
def test_eight_streaming_clients_each_get_their_own_whole_text(server: Server) -> None:
    def ask(seed: int, stream: bool) -> dict[str, object]:
        return {"messages": [{"role": "user", "content": f"Story number {seed}."}], "max_tokens": 10,
                "temperature": 0.9, "seed": seed, "stream": stream}  # fmt: skip

    def streamed(seed: int) -> tuple[int, str]:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=ask(seed, True), timeout=300) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, ""
            text = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    choices = json.loads(line[6:])["choices"]
                    if choices:
                        text.append(choices[0]["delta"].get("content") or "")
            return 200, "".join(text)

    want = {s: httpx.post(server.url + "/v1/chat/completions", json=ask(s, False), timeout=120)
            .json()["choices"][0]["message"]["content"] for s in range(8)}  # fmt: skip
    rss_before = server.rss_kib()
    got: dict[int, list[tuple[int, str]]] = {s: [] for s in range(8)}

    def client(seed: int) -> None:
        for _ in range(5):
            got[seed].append(streamed(seed))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for seed, answers in got.items():
        assert len(answers) == 5
        for status, text in answers:
            assert status in (200, 429, 503), status
            if status == 200:
                assert text == want[seed], (seed, text, want[seed])  # its own seeded text, whole, never mixed
    assert sum(status == 200 for a in got.values() for status, _ in a) >= 8
    assert server.rss_kib() <= 1.05 * rss_before


@pytest.mark.slow
def test_a_client_that_goes_away_mid_stream_frees_the_engine(tmp_path: Path) -> None:
    # A model that never ends a reply by itself (its special tokens' output rows are zero: their logits
    # never lead): however slowly the client leaves on a busy machine, the engine is still generating.
    arch, meta, tensors, vocab = tiny_moe_parts(n_layers=3, n_vocab=300)
    tensors["output.weight"][0][list(vocab.specials.values())] = 0
    model = write_gguf(tmp_path / "endless.gguf", arch, meta, tensors, vocab=vocab, template=QWEN_TEMPLATE)
    s = Server(model, "-c", "4096")  # room for a reply far longer than the client waits for
    try:
        cancelled = _metric(s, "moechat_requests_cancelled_total")
        with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "long"}], "stream": True,
                                "max_tokens": 4000}) as r:  # fmt: skip
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
        deadline = time.monotonic() + 60
        while _metric(s, "moechat_requests_cancelled_total") <= cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(s, "moechat_requests_cancelled_total") == cancelled + 1
        assert _metric(s, "moechat_completion_tokens_total") < 4000  # it stopped well before its end
        good = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 3}, timeout=120)  # fmt: skip
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] <= 3
    finally:
        s.stop()


@pytest.fixture(scope="module")
def many(model: Path) -> Iterator[Server]:
    """A server that decodes two requests together (--parallel 2)."""
    s = Server(model, "--parallel", "2")
    yield s
    s.stop()


def _chat(server: Server, content: str, n: int = 12, **extra: object) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                   json={"messages": [{"role": "user", "content": content}], "max_tokens": n, "temperature": 0,
                         **extra})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def test_clients_served_together_each_get_the_text_they_get_alone(many: Server) -> None:
    """--parallel 2: four greedy clients at once (two wait for a slot) each get the text the same request gets
    alone; the decode steps ran two tokens at once, and /metrics and /moechat/stats say what the slots did."""
    prompts = ["Cats sleep all day.", "Rivers run to the sea.", "Bread needs an oven.", "Stars shine at night."]
    together: dict[int, str] = {}

    def client(i: int) -> None:
        together[i] = _chat(many, prompts[i])["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    steps = _metric(many, "moechat_decode_steps_total")
    alone = {i: _chat(many, p)["choices"][0]["message"]["content"] for i, p in enumerate(prompts)}
    assert together == alone
    assert _metric(many, "moechat_slots") == 2 and _metric(many, "moechat_slots_active") == 0
    assert steps < 4 * 12  # (tokens of two requests went through in one step)
    batch = httpx.get(many.url + "/moechat/stats", timeout=30).json()["batch"]
    assert batch["slots"] == 2 and len(batch["slot_tps"]) == 2 and batch["steps"] >= steps


def test_two_conversations_served_in_turn_each_reuse_their_prefix(many: Server) -> None:
    """Two agents' growing contexts sent in turn: each finds its conversation on its own slot."""
    chats = [[{"role": "user", "content": "Name a mountain in the Alps."}],
             [{"role": "user", "content": "Count to five in French."}]]  # fmt: skip
    for turn in range(2):
        for chat in chats:
            r = httpx.post(many.url + "/v1/chat/completions", timeout=300,
                           json={"messages": chat, "max_tokens": 6, "temperature": 0}).json()  # fmt: skip
            if turn:
                cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached > len(chat) * 4, r["usage"]  # (the first turn's prompt and reply, at least)
            chat += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And then?"}]  # fmt: skip


@pytest.mark.slow
def test_more_clients_than_slots_are_all_answered_and_memory_stays_flat(many: Server) -> None:
    """Twelve clients at once on two slots, three rounds: every request is answered (they wait for a slot, none
    is refused or lost), each with its own seeded text, and the server's memory does not grow round by round."""

    def ask(seed: int) -> tuple[int, str]:
        r = httpx.post(many.url + "/v1/chat/completions", timeout=600,
                       json={"messages": [{"role": "user", "content": f"Story {seed}."}], "max_tokens": 8,
                             "temperature": 0.9, "seed": seed})  # fmt: skip
        return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text

    rss = []
    texts: dict[int, set[str]] = {s: set() for s in range(12)}
    for _ in range(3):
        got: dict[int, tuple[int, str]] = {}

        def client(seed: int, into: dict[int, tuple[int, str]] = got) -> None:
            into[seed] = ask(seed)

        threads = [threading.Thread(target=client, args=(s,)) for s in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert sorted(got) == list(range(12)) and all(status == 200 for status, _ in got.values()), got
        for seed, (_, text) in got.items():
            texts[seed].add(text)
        rss.append(many.rss_kib())
    assert all(len(t) == 1 for t in texts.values())  # the same seeded text each round, whoever else was served
    assert rss[-1] <= 1.05 * rss[0]


def _metric(server: Server, name: str) -> float:
    m = re.search(rf"^{name} ([\d.e+]+)$", httpx.get(server.url + "/metrics", timeout=30).text, re.M)
    assert m is not None
    return float(m[1])


def test_an_api_key_guards_every_endpoint_but_health(model: Path) -> None:
    s = Server(model, "--api-key", KEY)
    try:
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        lower = httpx.get(s.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}, timeout=30)
        assert lower.status_code == 200  # the scheme's case does not matter
        wrong: list[dict[str, str]] = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}]
        wrong.append({"Authorization": f"Basic {KEY}"})
        for headers in wrong:
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions")):
                r = httpx.request(method, s.url + path, headers=headers, json={}, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, path)
        ok = _openai(s, KEY).chat.completions.create(  # type: ignore[attr-defined]
            model="m.gguf", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert ok.choices[0].message.content
    finally:
        s.stop()


def test_a_non_loopback_address_without_a_key_warns_and_bad_flags_fail_in_one_line(model: Path) -> None:
    r = subprocess.run([*MOECHAT, "serve", str(model), "--port", "70000"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == "moechat: error: --port must be in 0..65535, got 70000"
    s = Server(model, "--host", "0.0.0.0")  # bound only: no request goes to it
    try:
        assert "moechat: warning: serving on 0.0.0.0 without --api-key" in s.head, s.head
    finally:
        s.stop()
    from moechat.app.serve.command import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")


async def test_attach_shows_the_servers_numbers_moving_while_another_client_generates(
    server: Server, tmp_path: Path
) -> None:
    """`moechat attach`: the chat app on the server, its dashboard fed by the server's snapshots (the
    engine's own type), its chat a client like any other."""
    from moechat.app.paths import AppPaths
    from moechat.app.serve.remote import RemoteEngine
    from moechat.app.settings import Settings
    from moechat.app.tui import MoechatApp
    from moechat.widgets.dashboard import Dashboard
    from testkit.pilot import ready, say, until

    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    app = MoechatApp(lambda progress: RemoteEngine(server.url), Settings(refresh_ms=100, temp=0.0), paths=paths,
                     attached=True)  # fmt: skip
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        assert app.engine.info.name == "m.gguf"
        dash = screen.query_one(Dashboard)
        await until(pilot, lambda: app.session.snapshot is not None, timeout=60)
        assert app.session.snapshot is not None
        before, updates = app.session.snapshot.total.lookups, dash.updates
        other = threading.Thread(target=lambda: httpx.post(
            server.url + "/v1/chat/completions", timeout=120,
            json={"messages": [{"role": "user", "content": "Another client speaks."}], "max_tokens": 30}))  # fmt: skip
        other.start()
        await until(pilot, lambda: app.session.snapshot is not None and app.session.snapshot.total.lookups > before,
                    timeout=120)  # fmt: skip
        other.join(120)
        assert dash.updates > updates
        # The server's own numbers, as /moechat/stats has them (all but the time each was taken).
        remote = RemoteEngine(server.url)

        def same() -> bool:
            ours, theirs = app.session.snapshot, remote.snapshot()
            return ours is not None and theirs is not None and replace(ours, time=0) == replace(theirs, time=0)

        await until(pilot, same, timeout=60)
        await say(pilot, screen, "hello there")
        reply = screen.conv.messages[-1]
        assert reply["role"] == "assistant" and "stats" in reply and reply["stats"]["n_generated"] > 0, reply
        want = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "hello there"}], "temperature": 0}).json()  # fmt: skip
        assert reply["content"] == want["choices"][0]["message"]["content"].strip()
        # The wizard measures the server's machine: from here it is refused in one line, and the
        # session's counters stay the server's (they were added twice once the wizard had opened).
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert app.screen is screen and not app.session.periods
        assert any("tuning runs on the server's machine" in n.message for n in app._notifications)
        await pilot.press("escape")
        await until(pilot, same, timeout=60)
        remote.close()
        theirs = RemoteEngine(server.url)
        snap = theirs.snapshot()
        theirs.close()
        assert snap is not None and app.session.to_dict()["tokens"] == snap.tokens


def test_a_conversation_that_grows_reuses_the_kv_of_the_request_before(server: Server) -> None:
    """An agent's context grows request by request: the part the engine holds is not read again."""
    client = _openai(server)
    first_messages = [{"role": "user", "content": "Name a river."}]
    first = client.chat.completions.create(model="m.gguf", messages=first_messages, max_tokens=6,  # type: ignore[attr-defined]
                                           temperature=0)  # fmt: skip
    grown = [*first_messages, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And another?"}]  # fmt: skip
    second = client.chat.completions.create(model="m.gguf", messages=grown, max_tokens=6, temperature=0)  # type: ignore[attr-defined]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


def test_the_same_seeded_request_twice_gives_the_same_text(server: Server) -> None:
    """The second request finds its whole prompt in the KV cache: it starts from the logits kept after
    the first one's prompt, not from its last token read again by the one-token path."""
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 24,
            "temperature": 1.0, "top_p": 1.0, "seed": 42}  # fmt: skip
    texts = []
    for _ in range(2):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        texts.append((r.json()["choices"][0]["message"]["content"], r.json()["usage"]))
    assert texts[0][0] == texts[1][0]
    assert texts[1][1]["prompt_tokens_details"]["cached_tokens"] == texts[1][1]["prompt_tokens"]


def test_the_port_is_bound_before_the_model_loads(model: Path) -> None:
    """A port in use is one line and exit 2 before any load; /health says loading until the model is ready."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        r = subprocess.run([*MOECHAT, "serve", str(model), "--port", str(port)], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    finally:
        taken.close()
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"moechat: error: --port {port}: 127.0.0.1:{port} is in use (another server?); pick another port, "
        "or --port 0 for any free one"
    ]
    env = {**os.environ, "MOECHAT_COMPILE_AHEAD": "0"}
    proc = subprocess.Popen([*MOECHAT, "serve", str(model), "--port", "0", *FLAGS], stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"listening on (http://[\d.]+:\d+) \(loading", line)
        assert m is not None, line
        url = m.group(1)
        health = httpx.get(url + "/health", timeout=30)  # the engine's process is still starting
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        early = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                           timeout=30)  # fmt: skip
        assert early.status_code == 503 and early.json()["error"]["code"] == "loading"
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line, "the server ended while loading"
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_the_api_key_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key on the command line shows in `ps`; MOECHAT_API_KEY keeps it out, for serve and attach alike."""
    from moechat.app.cli import build_parser

    monkeypatch.setenv("MOECHAT_API_KEY", KEY)
    assert build_parser().parse_args(["attach"]).api_key == KEY
    assert build_parser().parse_args(["serve", "m.gguf"]).api_key == KEY
    assert build_parser().parse_args(["serve", "m.gguf", "--api-key", "other"]).api_key == "other"
    monkeypatch.delenv("MOECHAT_API_KEY")
    assert build_parser().parse_args(["attach"]).api_key is None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
def test_the_http_process_maps_no_torch(server: Server) -> None:
    """The model runs in the engine's process: the server's own (HTTP, the queue, /metrics) loads neither
    torch nor numba (it mapped libtorch 12 times through the stop strings' module and the app's)."""
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "numba" not in maps
