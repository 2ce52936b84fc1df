"""A new user's first and second start of `moechat` in a real terminal (tmux), timed from the outside.

    python bench/first_start.py [--model M.gguf] [--keep-demo] [--n 16]

The first start runs with an empty moechat home (no demo built, no settings) and an empty kernel
cache; it answers from the exact path while a helper process compiles the kernels in the background
(engine/models/first_start.py). The bench waits for that helper to finish (reported as "kernels
compiled", from the first start's launch), then the second start reuses both. Each start types
"Hello" as soon as the app is drawn and reports, in seconds from the command's launch:

- ui: the app is drawn with its input focused (a message typed now is kept and queued);
- ready: the engine is loaded (the info line names the template);
- first reply: the reply's stats line is on screen;
- silence: the longest stretch before `ready` whose screen showed no loading news (the info line's
  text unchanged while it says loading, building or compiling); "progress on screen all along".

The demo's source is fetched by pip on the first start unless `--keep-demo` reuses the built demo
of this user's own home (then the first start measures compiling only) or `--keep-source` its fetched
source (the first start builds the demo, as after a download).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

LOADING_WORDS = ("loading", "building", "compiling", "fetching")


def pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def info_line(screen: str) -> str:
    """The chat pane's first two lines: what the load is doing (a first start's kernel count is on the
    second), or the model's description once loaded."""
    lines = [line.split("\u2502")[0].strip() for line in screen.splitlines()]
    lines = [text for text in lines if text]
    return " ".join(lines[:2])


def one_start(exe: str, model: str | None, home: Path, kernels: Path, n: int, timeout: float) -> dict[str, float]:
    session = f"moechat-bench-{uuid.uuid4().hex[:8]}"
    env = f"env MOECHAT_HOME={shlex.quote(str(home))} NUMBA_CACHE_DIR={shlex.quote(str(kernels))} TERM=xterm-256color"
    cmd = f"{env} {shlex.quote(exe)} {shlex.quote(model) if model else ''} -n {n} --temp 0"
    t0 = time.monotonic()
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", cmd], check=True)
    out: dict[str, float] = {}
    last_text, last_change, silence = "", t0, 0.0
    try:
        while time.monotonic() - t0 < timeout:
            screen = pane(session)
            now = time.monotonic() - t0
            if "ui" not in out and "^p palette" in screen:
                out["ui"] = now
                subprocess.run(["tmux", "send-keys", "-t", session, "Hello", "Enter"], check=True)
            if "ui" in out and "ready" not in out:
                text = info_line(screen)
                if "template:" in screen:
                    out["ready"] = now
                elif text != last_text or not any(w in text for w in LOADING_WORDS):
                    last_text, last_change = text, now
                silence = max(silence, now - last_change) if "ready" not in out else silence
            if "ready" in out and " tok read" in screen:
                out["first reply"] = now
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"no reply within {timeout:.0f} s; the screen was:\n{pane(session)}")
        out["silence"] = silence
        subprocess.run(["tmux", "send-keys", "-t", session, "C-q"], check=True)
        time.sleep(1.0)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    return out


def helpers_running() -> bool:
    """Whether a compile helper (engine/models/compile_ahead.py) still runs on this machine."""
    found = subprocess.run(["pgrep", "-f", "moechat.engine.models.compile_ahead"], capture_output=True, text=True)
    return bool(found.stdout.strip())


def wait_helpers(t0: float, timeout: float) -> float:
    """Seconds from `t0` until no compile helper runs (the first start's background compile is through)."""
    while helpers_running() and time.monotonic() - t0 < timeout:
        time.sleep(0.5)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file (default: the built-in demo)")
    ap.add_argument("--keep-demo", action="store_true", help="copy this user's built demo into the fresh home")
    ap.add_argument(
        "--keep-source",
        action="store_true",
        help="copy this user's fetched demo source into the fresh home (the demo is built, not fetched)",
    )
    ap.add_argument("--n", type=int, default=16, help="reply tokens")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    exe = shutil.which("moechat")
    if exe is None or shutil.which("tmux") is None:
        print("needs the installed moechat and tmux", file=sys.stderr)
        return 2
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        home, kernels = Path(tmp) / "home", Path(tmp) / "kernels"
        if (args.keep_demo or args.keep_source) and not args.model:
            from moechat.app.paths import app_paths

            (home / "cache").mkdir(parents=True)
            if args.keep_source:
                shutil.copytree(app_paths().cache / "sources", home / "cache" / "sources")
            for built in app_paths().cache.glob("moechat-demo-*.gguf") if args.keep_demo else ():
                shutil.copy(built, home / "cache" / built.name)
        if helpers_running():
            print("a compile helper of another start is running: its load would skew the figures", file=sys.stderr)
            return 2
        t0 = time.monotonic()
        first = one_start(exe, args.model, home, kernels, args.n, args.timeout)
        compiled = wait_helpers(t0, args.timeout)
        second = one_start(exe, args.model, home, kernels, args.n, args.timeout)
        rows = [("first start", first), ("second start", second)]
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"kernels compiled in the background: {compiled:.1f} s after the first start's launch")
    print(f"{'':14} {'ui (input usable)':>18} {'engine ready':>13} {'first reply':>12} {'longest silence':>16}")
    for name, r in rows:
        print(f"{name:14} {r['ui']:17.1f}s {r['ready']:12.1f}s {r['first reply']:11.1f}s {r['silence']:15.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
