"""A model split over 2 and 3 processes on this machine (gloo on 127.0.0.1): the same greedy tokens as one process."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.distributed.plan import plan_split
from moechat.engine.events import GREEDY, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import load_model
from moechat.engine.models.opening import open_model
from moechat.tuner.simulator import load_routing, replay
from testkit.distributed import N_TOKENS, PROMPT, run_ranks
from testkit.ggufgen import tiny_moe


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "qwen35moe"])
def test_a_split_model_writes_what_one_process_writes(tmp_path: Path, arch: str) -> None:
    path = tiny_moe(tmp_path / "m.gguf", arch=arch, n_layers=4, n_expert=8, n_expert_used=2)
    one_trace, split_trace = tmp_path / "one.trace", tmp_path / "split.trace"
    cache = CacheSettings(mib=1.5, cpu_share=0.5)  # each rank's own expert cache, with a CPU share
    lm = load_model(path, n_ctx=256, cache=replace(cache, trace=one_trace))
    moe_layers = sorted(lm.model.host_experts.layers)
    ids = lm.tokenizer.encode(PROMPT)
    reference = [e.token for e in generate(lm.model, lm.tokenizer, ids, lm.new_cache(), max_tokens=N_TOKENS,
                                           params=GREEDY, ignore_eos=True)
                 if isinstance(e, TokenEvent) and e.token >= 0]  # fmt: skip
    lm.close()
    assert len(reference) == N_TOKENS
    for world, settings in ((2, None), (2, cache), (3, replace(cache, trace=split_trace))):
        results = run_ranks(path, world, settings)
        assert results[0][0] == reference, (world, results)
        assert all(results[r][0] is None for r in range(1, world)), results  # the other ranks served
        merged, n_groups = results[0][2], results[0][3]
        if settings is None:
            assert merged is None  # no stage has a cache
        else:  # each stage's cache counted its own layers; rank 0 sees them all, by their own indices
            assert sorted(merged) == moe_layers, merged
            lookups = {c.lookups for c, _ in merged.values()}
            assert len(lookups) == 1 and lookups.pop() > 0  # every layer looked up every token
            assert {g for _, g in merged.values()} == set(range(n_groups)) and n_groups >= 2  # from several stages
            if settings.trace is not None:
                # The stages' traces joined are the one process's routing, lookup by lookup, and replay to
                # the counters the stages' caches kept, each stage with its own budget.
                joined, one = load_routing(split_trace), load_routing(one_trace)
                # (Predictions too, but for a stage's first layer, which no stage predicts: the one before is
                # in another process.)
                lookups_only = [r for r in joined.records if r[0] >= 0]
                assert lookups_only == [r for r in one.records if r[0] >= 0] and len(lookups_only) > len(moe_layers)
                ahead = [r for r in joined.records if r[0] < 0]
                assert ahead and set(ahead) < {r for r in one.records if r[0] < 0}
                assert joined.stages is not None and len(joined.stages) == n_groups == len(joined.groups)
                assert not list(tmp_path.glob("split.stage*.trace"))  # the stages' parts are gone
                sim = replay(joined, cache.mib, cache.cpu_share, warmup=0)
                assert {layer: c.total for layer, c in sim.layers.items()} == {k: c for k, (c, _) in merged.items()}
                assert sum(c.cpu for c, _ in merged.values()) > 0 and sum(c.hits for c, _ in merged.values()) > 0
                sim_cmd = subprocess.run([sys.executable, "-m", "moechat", "sim", str(split_trace), "--warmup", "0"],
                                         capture_output=True, text=True, timeout=120)  # fmt: skip
                assert sim_cmd.returncode == 0 and f"split over {len(joined.stages)} hosts" in sim_cmd.stdout, sim_cmd
        # Each rank has only its own part of the file in memory: its layers (rank 0: and the ends).
        gguf, cfg = open_model(path)
        with gguf:
            plan = plan_split(gguf, cfg, [64 * 2**30] * world, 256)
        page = 4096
        for h in plan.hosts:
            resident = results[h.rank][1]
            # The kernel's readahead may map a few pages more on a busy machine (68 once, on two workers): the
            # bound still refuses another stage's layer (megabytes).
            assert h.weight_bytes <= resident + page * 4 and resident <= h.weight_bytes * 1.02 + 128 * page, (
                world, h, resident)  # fmt: skip


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_run_on_rank_0_with_one_line() -> None:
    import tempfile
    import time

    from testkit.distributed import LOST_TIMEOUT_S, start_until_lost

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_moe(Path(tmp) / "m.gguf", n_layers=4, n_expert=8, n_expert_used=2)
        procs, out = start_until_lost(path, 3)
        try:
            assert out.get(timeout=300)[1] == "writing"  # the split runs
            procs[2].kill()  # the last rank, mid-reply
            killed = time.monotonic()
            while True:
                rank, message, *when = out.get(timeout=2 * LOST_TIMEOUT_S + 30)
                if rank == 0 and message != "writing":
                    break
            assert message.startswith("RankLost: a rank of the split stopped answering (")
            assert "\n" not in message and len(message) < 300
            assert when[0] - killed < LOST_TIMEOUT_S + 10  # within the group's timeout, not a hang
        finally:
            for p in procs:
                p.kill()
                p.join(10)


@pytest.mark.slow
def test_serving_ranks_wait_for_rank_0_longer_than_the_groups_timeout(tmp_path: Path) -> None:
    """A chat's user may think for minutes: the serving ranks wait for the next forward as long as it
    takes (a lost rank is still noticed at once, by its closed connection)."""
    path = tiny_moe(tmp_path / "m.gguf", n_layers=4, n_expert=8, n_expert_used=2)
    results = run_ranks(path, 2, None, timeout_s=2.0, pause_s=5.0)
    assert isinstance(results[0], tuple), results
    first, again = results[0][0]
    assert first == again and len(first) == N_TOKENS


@pytest.mark.slow
def test_a_rank_with_another_file_is_refused_before_any_work(tmp_path: Path) -> None:
    same = tiny_moe(tmp_path / "m.gguf", n_layers=4, n_expert=8, n_expert_used=2)
    other = tiny_moe(tmp_path / "other.gguf", n_layers=4, n_expert=8, n_expert_used=2, seed=1)
    results = run_ranks([same, same, other], 3, None)
    for rank in range(3):  # every rank stops, each saying which rank differs
        assert results[rank] == ("ValueError: rank 2 runs another model file than rank 0: every host needs the "
                                 "very same file"), results  # fmt: skip


@pytest.mark.slow
def test_moechat_run_under_torchrun_is_one_process_to_the_user(tmp_path: Path) -> None:
    """`torchrun ... -m moechat run`: rank 0 prints what one process prints (rank 1 nothing), and the
    cache summary counts every layer's lookups over both stages."""
    path = tiny_moe(tmp_path / "m.gguf", n_layers=4)
    flags = ["run", str(path), "-p", PROMPT, "-n", "10", "--temp", "0", "--raw", "-t", "1",
             "--moe-cache-mib", "0.5", "--moe-cache-cpu-share", "0.5"]  # fmt: skip
    one = subprocess.run([sys.executable, "-m", "moechat", *flags], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    # As docs/usage.md starts it: the installed command, not `-m moechat`, which a clone's folder named
    # moechat in the working directory would shadow (run from the clone's parent, it failed to import).
    (tmp_path / "moechat").mkdir()
    script = shutil.which("moechat")
    if script is None:
        if os.environ.get("MOECHAT_CI"):
            pytest.fail("the installed `moechat` command is not on PATH")
        pytest.skip("the installed `moechat` command is not on PATH")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python"]
    two = subprocess.run([*torchrun, script, *flags], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.strip()

    def lookups(err: str) -> int:
        m = re.search(r"hits = (\d+), misses = (\d+)", err)
        assert m is not None, err[-2000:]
        return int(m.group(1)) + int(m.group(2))

    assert lookups(two.stderr) == lookups(one.stderr) > 0


@pytest.mark.slow
def test_a_line_chat_under_torchrun_is_one_process_to_the_user(tmp_path: Path) -> None:
    """`torchrun ... -m moechat chat --plain`: rank 0 chats turn by turn as one process does (the
    conversation's KV cache kept on every stage from one turn to the next), and every rank keeps its
    own warm start."""
    path = tiny_moe(tmp_path / "m.gguf", n_layers=4)
    flags = ["chat", str(path), "--plain", "-n", "6", "--temp", "0", "-t", "1", "--moe-cache-mib", "0.5",
             "--moe-cache-cpu-share", "0.5", "-v"]  # fmt: skip
    turns = "Hello there\nWhat next?\n"
    one = subprocess.run([sys.executable, "-m", "moechat", *flags], input=turns, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.run([*torchrun, "-m", "moechat", *flags], input=turns, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.strip()

    def read(err: str) -> list[tuple[int, int]]:  # each turn: (tokens read, of them kept from the turn before)
        return [(int(a), int(b)) for a, b in re.findall(r"prompt: (\d+) tokens read \((\d+) kept\)", err)]

    assert read(two.stderr) == read(one.stderr) and len(read(one.stderr)) == 2 and read(one.stderr)[1][1] > 0
    warm = sorted(p.name.split(".", 1)[1] for p in (tmp_path / "moechat-home" / "data" / "warm").iterdir())
    assert warm == ["json", "stage0.json", "stage1.json"], warm  # one process's, then each rank's own


@pytest.mark.slow
def test_the_chat_apps_engine_as_rank_0_of_a_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app's engine process joins a split as rank 0 (torchrun gave the app RANK and WORLD_SIZE); a
    `moechat chat` started as rank 1 serves. Replies, counters and cache changes reach both stages,
    the tuning wizard says why it does not run, and a lost rank fails the next reply with one line."""
    import threading
    import time

    from moechat.app.engine_process import EngineProcessError, EngineSpec, ProcessEngine
    from moechat.app.settings import Settings
    from moechat.engine.events import SamplingParams, TokenEvent
    from testkit.distributed import free_port

    path = tiny_moe(tmp_path / "m.gguf", n_layers=4)
    settings = Settings(ctx_size=256, device="cpu", moe_cache_mib=0.5, moe_cache_cpu_share=0.5, threads=1)
    messages = [{"role": "user", "content": "Hello"}]

    def reply(engine: ProcessEngine, prompt: list[int]) -> str:
        events = engine.reply(prompt, SamplingParams(temperature=0.0), 8, threading.Event())
        return "".join(e.text for e in events if isinstance(e, TokenEvent))

    alone = ProcessEngine(EngineSpec(str(path), settings))
    try:
        prompt = alone.fit_messages(messages)[0]
        want = reply(alone, prompt)
    finally:
        alone.close()
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    rank1 = subprocess.Popen([sys.executable, "-m", "moechat", "chat", str(path), "-t", "1", "-c", "256",
                              "--moe-cache-mib", "0.5", "--moe-cache-cpu-share", "0.5"],
                             env={**os.environ, **env, "RANK": "1"}, stdin=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    for k, v in {**env, "RANK": "0"}.items():
        monkeypatch.setenv(k, v)  # what torchrun gives the app's process; its engine process inherits it
    engine = ProcessEngine(EngineSpec(str(path), settings))
    try:
        assert reply(engine, prompt) == want and want
        snap = engine.snapshot()
        assert snap is not None and len(snap.groups) == 2  # one cache per stage, every MoE layer shown
        assert sorted(x.layer for x in snap.layers) == [0, 1, 2, 3] and snap.total.lookups > 0
        engine.set_cache(1.0, 0.25)
        assert engine.cache() == (1.0, 0.25)
        snap = engine.snapshot()
        assert snap is not None and snap.total.lookups == 0 and snap.cpu_share == 0.25  # both stages anew
        assert reply(engine, prompt) == want  # greedy: the same reply at any cache size
        with pytest.raises(ValueError, match="split over hosts"):
            list(engine.sweep(threading.Event(), None, 16))
        rank1.kill()
        rank1.wait(30)
        lost = time.monotonic()
        with pytest.raises(EngineProcessError) as failed:
            reply(engine, prompt)
        assert str(failed.value).startswith("RankLost: a rank of the split stopped answering (")
        assert "\n" not in str(failed.value) and time.monotonic() - lost < 60
    finally:
        engine.close()
        rank1.kill()
