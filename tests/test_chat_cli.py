"""`moechat chat` and `moechat` alone: line-mode chat over stdin, multi-turn through the template."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testkit.ggufgen import tiny_moe

# `moechat run`'s cache summary for decode-sized batches: hits, misses, misses computed on the CPU.
DECODE_COUNTS = re.compile(r"batch <= 8: hits = (\d+), misses = (\d+) \((\d+) on the CPU\)")


@pytest.mark.slow
def test_chat_two_turns_from_stdin(tmp_path: Path) -> None:
    """One reply per non-empty line, the second one answering the whole conversation."""
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=512)

    def chat(text: str, *flags: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "moechat", "chat", str(model), "-n", "6", "--seed", "1", "--temp", "0", *flags]
        return subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=120)

    r = chat("Hello there\n\nWhat next?\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    replies = r.stdout.split("\n")[:-1]
    one = chat("What next?\n")
    assert one.returncode == 0, one.stderr
    # Greedy: the same prompt gives the same reply; the two-turn chat's second prompt holds the
    # first turn, so its reply differs from "What next?" asked alone.
    assert one.stdout == chat("What next?\n").stdout
    assert len(replies) >= 2 and r.stdout != one.stdout and not r.stdout.endswith(one.stdout)


@pytest.mark.slow
def test_line_mode_drops_the_oldest_turns_when_the_context_is_full(tmp_path: Path) -> None:
    """As the app does: a long chat keeps going, the oldest messages left out, and says so."""
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=512)
    lines = "".join(f"tell me about the river and the sea number {i}\n" for i in range(8))
    r = subprocess.run([sys.executable, "-m", "moechat", "chat", str(model), "-n", "4", "-c", "96", "--temp", "0"],
                       input=lines, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "oldest messages no longer fit the context and are left out" in r.stderr
    assert r.stdout.count("\n") == 8  # every line was answered


@pytest.mark.slow
def test_moechat_alone_chats_with_the_demo(demo_home: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "moechat", "chat", "--temp", "0"],
                       input="What is bread made of?\n", capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    reply = r.stdout.strip().lower()
    assert any(word in reply for word in ("flour", "wheat", "yeast", "grain")), reply
    r = subprocess.run([sys.executable, "-m", "moechat"], input="", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == ""  # empty stdin: the chat ends at once


@pytest.mark.slow
def test_moechat_run_on_the_demo_uses_its_expert_cache(demo_home: Path) -> None:
    # The demo's own defaults turn the cache on (half its experts), with a CPU share, unless the
    # user says otherwise.
    cmd = [sys.executable, "-m", "moechat", "-v", "run", "-p", "Bread is", "-n", "8", "--temp", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"MoE cache group 0: layers 0-29, 16 experts .*\(50.0% of the experts.*CPU share 0.5$", r.stderr,
                     re.MULTILINE), r.stderr  # fmt: skip
    m = DECODE_COUNTS.search(r.stderr)
    assert m is not None, r.stderr
    hits, misses, cpu = map(int, m.groups())
    assert hits > 0 and misses > 0 and cpu == 0  # 8 tokens do not fill half the experts
    # A smaller cache fills within the reply; then the demo's CPU share takes misses.
    small = subprocess.run([*cmd, "--moe-cache-mib", "40"], capture_output=True, text=True, timeout=300)
    m = DECODE_COUNTS.search(small.stderr)
    assert small.returncode == 0 and m is not None and int(m.group(3)) > 0, small.stderr
    off = subprocess.run([*cmd, "--moe-cache-mib", "0"], capture_output=True, text=True, timeout=300)
    assert off.returncode == 0 and "MoE cache" not in off.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_line_chat_names_where_an_unusable_device_came_from(tmp_path: Path) -> None:
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=512)
    env = {**os.environ, "MOECHAT_DEVICE": "cuda"}
    r = subprocess.run([sys.executable, "-m", "moechat", "chat", str(model), "--plain"], input="Hi\n",
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("moechat: error: device from env MOECHAT_DEVICE:"), r.stderr


@pytest.mark.slow
def test_moechat_run_on_the_demo_samples_as_the_demo_does(demo_home: Path) -> None:
    # Without sampling flags, `run` on the demo takes the demo's own temperature and repeat penalty.
    def run(*flags: str) -> str:
        cmd = [sys.executable, "-m", "moechat", "run", "-p", "Tell me about the sea.", "-n", "24", "--seed", "3"]
        r = subprocess.run([*cmd, "--moe-cache-mib", "0", *flags], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    own = run()
    assert own == run("--temp", "0.3", "--repeat-penalty", "1.1")
    assert own != run("--temp", "1.5", "--repeat-penalty", "1")


@pytest.mark.slow
def test_line_mode_saves_what_the_app_saves_and_prints_stats_with_v(tmp_path: Path, _isolated_home: Path) -> None:
    """Line mode as a full citizen: the conversation, the session's stats and the expert cache's use
    counts (the next start's warm start) are saved; `-v` after the command prints each reply's stats,
    the second turn reading only what it appended."""
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=512)
    cmd = [sys.executable, "-m", "moechat", "chat", str(model), "-v", "-n", "6", "--temp", "0", "--moe-cache-mib", "1"]
    r = subprocess.run(cmd, input="Hello there\nWhat next?\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "DEBUG moechat." in r.stderr and "numba" not in r.stderr  # -v is moechat's messages, not its libraries'
    stats = re.findall(r"prompt: (\d+) tokens read \((\d+) kept\), [\d.]+ t/s \| generation: (\d+) tokens", r.stderr)
    assert len(stats) == 2, r.stderr
    (read1, kept1, _), (_, kept2, _) = [tuple(map(int, s)) for s in stats]
    assert kept1 == 0 and kept2 >= read1 > 0  # the second turn: the first prompt is kept, not read again
    assert "hits" in r.stderr  # the cache's summary lines
    data = _isolated_home / "data"
    (conv_file,) = (data / "conversations").glob("*.json")
    conv = json.loads(conv_file.read_text())
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant", "user", "assistant"]
    assert conv["messages"][-1]["stats"]["n_kept"] == kept2
    (session_file,) = (data / "sessions").glob("*.json")
    session = json.loads(session_file.read_text())
    assert len(session["replies"]) == 2 and session["layers"]
    assert list((data / "warm").glob("*.json"))  # the use counts, for the next start's warm start
    # `moechat run` starts warm from them too.
    run = [sys.executable, "-m", "moechat", "run", str(model), "-p", "Hi", "-n", "3", "--moe-cache-mib", "1", "-v"]
    r = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and re.search(r"warm start: [1-9]\d* experts", r.stderr), r.stderr
