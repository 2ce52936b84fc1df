"""`moechat chat` and `moechat` alone: line-mode chat over stdin, multi-turn through the template."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from testkit.ggufgen import tiny_moe


def test_chat_two_turns_from_stdin(tmp_path: Path) -> None:
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=512)
    r = subprocess.run([sys.executable, "-m", "moechat", "chat", str(model), "-n", "6", "--seed", "1"],
                       input="Hello there\n\nWhat next?\n", capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) >= 2  # one reply per non-empty line
    assert "Traceback" not in r.stderr


def test_moechat_alone_chats_with_the_demo(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "moechat", "chat", "-n", "12", "--temp", "0"],
                       input="The capital of France is\n", capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    reply = r.stdout.strip()
    assert reply and sum(c.isascii() for c in reply) >= 0.9 * len(reply)
    r = subprocess.run([sys.executable, "-m", "moechat"], input="", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == ""  # empty stdin: the chat ends at once
