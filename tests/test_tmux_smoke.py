"""The installed `moechat` in a real terminal (tmux, 120x40): starts, answers one prompt, quits on Ctrl+Q."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from testkit.ggufgen import tiny_moe

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def _pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def _wait(session: str, text: str, timeout: float = 90.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        screen = _pane(session)
        if text in screen:
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared; the screen was:\n{_pane(session)}")


def test_moechat_in_tmux(tmp_path: Path) -> None:
    exe = shutil.which("moechat")
    if exe is None:
        pytest.skip("the moechat script is not installed")
    model = tiny_moe(tmp_path / "m.gguf")
    session = f"moechat-{uuid.uuid4().hex[:8]}"
    done = tmp_path / "exit-code"
    env = {**os.environ, "MOECHAT_HOME": str(tmp_path / "home"), "TERM": "xterm-256color"}
    cmd = f"{exe} {model} -n 6 --temp 0 --moe-cache-mib 1; echo $? > {done}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", cmd], env=env, check=True)
    try:
        _wait(session, "^p palette")  # the footer: the app is up
        subprocess.run(["tmux", "send-keys", "-t", session, "Hello", "Enter"], check=True)
        screen = _wait(session, "reply 6 tok")
        assert "assistant" in screen and "hit rate" in screen
        subprocess.run(["tmux", "send-keys", "-t", session, "C-q"], check=True)
        end = time.monotonic() + 30
        while not done.exists() and time.monotonic() < end:
            time.sleep(0.2)
        assert done.read_text().strip() == "0"
        assert "Traceback" not in (tmp_path / "home" / "log" / "moechat.log").read_text()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
