"""`moechat run` beside other busy processes, against the same run on a quiet machine, side by side.

    python bench/contention.py [--model M.gguf] [--other Q12.gguf] [--peer SmolLM2.gguf] [--rounds 3]

Each round runs the same `moechat run` (greedy, a fixed prompt, `--ignore-eos`) once per condition,
alternating, so the machine's drift falls on every condition alike:

- quiet: nothing else started;
- spin: one process spinning on one core (a busy loop);
- moechat: a second `moechat run` decoding (`--other`, default the same model) for the whole run;
- llama.cpp: llama-cpp-python decoding `--peer` on every core (only with `--peer`; it needs the
  `peer` extra);
- moechat+spin: the second `moechat run` and the spinning core together.

The load starts decoding before the measured run starts (a load process says so on its stdout). The
table gives each condition's median prompt and decode t/s and their ratio to quiet's median; the
goals of issue 75 are >= 0.6x beside a spinning core, >= 0.4x beside a second decoder, and >= 0.3x
(prompt and decode) beside a decoder and a spinning core together. `--threads` passes `-t` (default
0: the engine's own count, which gives way to other processes).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

STATS = re.compile(r"prompt: (\d+) tokens, ([\d.]+) t/s \| generation: (\d+) tokens, ([\d.]+) t/s")
PROMPT = (
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle on a stormy night, "
    "and about what the message says, who wrote it, and how the keeper answers it."
)
SPIN = "while True: pass"
LLAMA = """
import sys
from llama_cpp import Llama
m = Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=int(sys.argv[2]), verbose=False)
print("ready", flush=True)
while True:
    for _ in m.create_completion("Once upon a time", max_tokens=1500, temperature=0, stream=True):
        pass
"""


def moechat() -> list[str]:
    exe = Path(sys.executable).with_name("moechat")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "moechat.app.cli"]


class Load:
    """Processes that keep the machine busy while a measured run goes; started decoding, then killed."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def spin(self) -> None:
        self.procs.append(subprocess.Popen([sys.executable, "-c", SPIN]))

    def decoder(self, cmd: list[str]) -> None:
        """Start `cmd` and wait for its first byte on stdout: it is decoding (or, for the peer, loaded)."""
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        assert p.stdout is not None
        if not p.stdout.read(1):
            raise SystemExit(f"the load process ended before it decoded: {' '.join(cmd)}")

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs.clear()


def measured(args: argparse.Namespace) -> tuple[float, float]:
    cmd = [*moechat(), "run", *([args.model] if args.model else []), "-p", PROMPT, "-n", str(args.tokens)]
    cmd += ["--temp", "0", "--ignore-eos", "-t", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    m = STATS.search(out.stderr)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"moechat run failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    return float(m.group(2)), float(m.group(4))


def conditions(args: argparse.Namespace) -> dict[str, Callable[[Load], None]]:
    other = [*moechat(), "run", *([args.other] if args.other else []), "-p", PROMPT, "-n", "100000"]
    other += ["--ignore-eos", "--temp", "0"]
    out: dict[str, Callable[[Load], None]] = {
        "quiet": lambda load: None,
        "spin": lambda load: load.spin(),
        "moechat": lambda load: load.decoder(other),
    }
    if args.peer:
        peer = [sys.executable, "-c", LLAMA, args.peer, str(os.cpu_count() or 2)]
        out["llama.cpp"] = lambda load: load.decoder(peer)

    def both(load: Load) -> None:
        load.decoder(other)
        load.spin()

    out["moechat+spin"] = both
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the measured model (default: the demo)")
    ap.add_argument("--other", help="the second moechat run's model (default: the measured one)")
    ap.add_argument("--peer", help="a GGUF llama.cpp decodes as a load (needs llama-cpp-python)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--settle", type=float, default=1.0, help="seconds a load runs before the measured run")
    ap.add_argument("--only", help="comma-separated conditions to run (quiet is always run)")
    args = ap.parse_args()
    args.other = args.other or args.model

    conds = conditions(args)
    if args.only:
        keep = {"quiet", *args.only.split(",")}
        conds = {k: v for k, v in conds.items() if k in keep}
    measured(args)  # a first run loads the kernels' disk cache and the model's pages
    print(f"{os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.2f}; {args.rounds} rounds, "
          f"{args.tokens} tokens, -t {args.threads}")  # fmt: skip
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in conds}
    for r in range(args.rounds):
        for name, start in conds.items():
            load = Load()
            try:
                start(load)
                time.sleep(args.settle if name != "quiet" else 0)
                got[name].append(measured(args))
            finally:
                load.stop()
            pp, tg = got[name][-1]
            print(f"  round {r + 1} {name:13s} prompt {pp:7.1f} t/s  decode {tg:6.1f} t/s", flush=True)
    q_pp = statistics.median(p for p, _ in got["quiet"])
    q_tg = statistics.median(t for _, t in got["quiet"])
    print("\n| beside | prompt t/s | vs quiet | decode t/s | vs quiet |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in got.items():
        pp = statistics.median(p for p, _ in runs)
        tg = statistics.median(t for _, t in runs)
        print(f"| {name} | {pp:.1f} | {pp / q_pp:.2f}x | {tg:.1f} | {tg / q_tg:.2f}x |")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
