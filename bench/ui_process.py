"""The chat app's UI process as a user starts it: time to its first screen, time until the chat
takes input, its resident memory, and whether it maps torch or numba.

Runs `moechat MODEL` in tmux (a real terminal), several rounds, and prints a table. `--python-path`
runs another checkout's code instead (e.g. the code before a change), so two versions can be
compared side by side in one run:

    python bench/ui_process.py --rounds 3 --compare /path/to/old/pythonpath
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from testkit.ggufgen import tiny_moe


def _pane(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _maps(pid: int, *names: str) -> bool:
    text = Path(f"/proc/{pid}/maps").read_text()
    return any(n in text for n in names)


def one_start(model: Path, home: Path, python_path: str | None) -> dict[str, float | bool]:
    session = f"bench-{uuid.uuid4().hex[:8]}"
    env = f"MOECHAT_HOME={shlex.quote(str(home))} TERM=xterm-256color"
    if python_path:
        cache = shlex.quote(os.path.join(python_path, ".numba-cache"))  # each version clears other versions' kernels
        env += f" PYTHONPATH={shlex.quote(python_path)} NUMBA_CACHE_DIR={cache}"
    cmd = f"env {env} {shlex.quote(sys.executable)} -m moechat {shlex.quote(str(model))} --moe-cache-mib 1"
    t0 = time.monotonic()
    # Started outside the checkout: there `python -m moechat` would find the checkout's own package first.
    where = ["-c", str(home.parent)]
    subprocess.run(["tmux", "new-session", "-d", "-s", session, *where, "-x", "120", "-y", "40", cmd], check=True)
    first = ready = float("nan")
    try:
        end = t0 + 120
        while time.monotonic() < end:
            screen = _pane(session)
            if first != first and screen.strip():  # nan: not yet
                first = time.monotonic() - t0
            if "^p palette" in screen:
                ready = time.monotonic() - t0
                break
            time.sleep(0.02)
        shell = int(subprocess.run(["tmux", "display", "-p", "-t", session, "#{pane_pid}"],
                                   capture_output=True, text=True).stdout)  # fmt: skip
        # The pane runs the command itself (sh execs env, env execs python): the pane's process is the UI's.
        ui = shell
        return {"first_screen_s": first, "ready_s": ready, "ui_rss_mib": _rss_mib(ui),
                "ui_maps_torch": _maps(ui, "libtorch"), "ui_maps_numba": _maps(ui, "numba", "llvmlite")}  # fmt: skip
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", metavar="PYTHONPATH", help="also run the code found on this path, alternately")
    args = ap.parse_args()
    if shutil.which("tmux") is None:
        print("tmux is needed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_moe(Path(tmp) / "m.gguf")
        versions = {"this checkout": None, **({"--compare": args.compare} if args.compare else {})}
        results: dict[str, list[dict[str, float | bool]]] = {v: [] for v in versions}
        for path in versions.values():  # compiles each version's kernels first
            one_start(model, Path(tmp) / "home", path)
        for _ in range(args.rounds):
            for name, path in versions.items():
                # A warm start each time (kernels compiled, model file in the page cache): a second start.
                results[name].append(one_start(model, Path(tmp) / "home", path))
        print(f"load average: {os.getloadavg()[0]:.2f}; {args.rounds} rounds, alternating; median (min-max)")
        print("| code | first screen s | input ready s | UI process RSS MiB | UI maps torch | UI maps numba |")
        print("|---|---|---|---|---|---|")
        for name, rows in results.items():

            def col(key: str, rows: list[dict[str, float | bool]] = rows) -> str:
                v = [float(r[key]) for r in rows]
                return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

            torch_ = any(bool(r["ui_maps_torch"]) for r in rows)
            numba_ = any(bool(r["ui_maps_numba"]) for r in rows)
            print(
                f"| {name} | {col('first_screen_s')} | {col('ready_s')} | {col('ui_rss_mib')} | {torch_} | {numba_} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
