"""A prompt's speed under each CPU kernel mode, side by side in one process.

    python bench/prefill_widths.py MODEL.gguf [MODEL.gguf ...] [--tokens 512] [--rounds 5] [--modes fast,int16,int8]

Each mode loads the model once (the same file's bytes); rounds alternate the modes, each round one
prefill of --tokens random token ids from an empty KV cache. Prints the median tokens/s per mode
(the first round left out: page faults), each mode over the first one, the CPU's instruction path
and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_overhead import cpu_name
from moechat.engine.generate import prefill
from moechat.engine.loader import load_model, set_threads


def run(path: Path, modes: list[str], n_tokens: int, rounds: int) -> dict[str, float]:
    lms = {m: load_model(path, n_ctx=n_tokens + 8, cpu_kernels=m) for m in modes}
    ids = np.random.default_rng(0).integers(10, 3000, n_tokens).tolist()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds + 1):
        for m, lm in lms.items():
            cache = lm.new_cache()
            t = time.perf_counter()
            prefill(lm.model, ids, cache)
            times[m].append(time.perf_counter() - t)
    for lm in lms.values():
        lm.close()
    return {m: n_tokens / statistics.median(ts[1:]) for m, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="fast,int16,int8")
    args = ap.parse_args()
    modes = args.modes.split(",")
    set_threads(args.threads)
    print(f"CPU: {cpu_name()}; load average before: {os.getloadavg()[0]:.2f}")
    print(f"| model | {' | '.join(f'{m} t/s' for m in modes)} | {' | '.join(f'{m} / {modes[0]}' for m in modes[1:])} |")
    print(f"|---|{'---|' * (2 * len(modes) - 1)}")
    for path in args.models:
        tps = run(path, modes, args.tokens, args.rounds)
        ratios = " | ".join(f"{tps[m] / tps[modes[0]]:.2f}x" for m in modes[1:])
        print(f"| {path.name} | {' | '.join(f'{tps[m]:.1f}' for m in modes)} | {ratios} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
