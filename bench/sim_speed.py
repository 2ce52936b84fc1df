"""Simulator speed: expert lookups replayed per second through the engine's ClassLRU.

    python bench/sim_speed.py [--tokens 2000] [--trace TRACE]

Default trace: synthetic routing with Qwen3-30B-A3B's geometry (48 layers, 128 experts, top-8),
skewed (Zipf 1.0 over a per-layer permutation) and with reuse (each token keeps about half of
the previous token's experts), so hit rates look like a real model's. Prints lookups/s per
(size, share) for one process, then the wall time of the whole predicted t/s table the tuner
builds (8 sizes x 6 shares) with 1 and 2 worker processes.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from moechat.tuner.recommend import TABLE_SHARES, predict_rows
from moechat.tuner.simulator import Group, Routing, load_routing, replay
from moechat.tuner.time_model import TimeModel


def synthetic(n_tokens: int, n_layers: int = 48, n_expert: int = 128, k: int = 8, seed: int = 0) -> Routing:
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(n_expert)]
    perms = [rng.sample(range(n_expert), n_expert) for _ in range(n_layers)]
    prev: list[list[int]] = [[] for _ in range(n_layers)]
    records = []
    for _ in range(n_tokens):
        for layer in range(n_layers):
            keep = [e for e in prev[layer] if rng.random() < 0.5]
            ids = set(keep)
            while len(ids) < k:
                ids.add(perms[layer][rng.choices(range(n_expert), weights)[0]])
            prev[layer] = sorted(ids)
            records.append((layer, k, tuple(prev[layer])))
    expert_bytes = 3 * 768 * 2048 * 9 // 16  # Q4_K gate, up, down of 2048 x 768
    return Routing((Group(tuple(range(n_layers)), n_expert, expert_bytes),), k, 32, tuple(records))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--trace", default=None, help="replay a recorded trace instead")
    args = ap.parse_args()
    t = time.perf_counter()
    routing = load_routing(args.trace) if args.trace else synthetic(args.tokens)
    n_lookups = sum(len(ids) for _, _, ids in routing.records)
    print(f"trace: {routing.n_tokens} tokens, {n_lookups:,} expert lookups, {routing.full_mib():.0f} MiB of experts "
          f"(built in {time.perf_counter() - t:.1f} s)")  # fmt: skip
    print()
    print(f"{'cache':>6} {'share':>6} {'hit rate':>9} {'M lookups/s':>12}")
    full = routing.full_mib()
    for frac in (0.1, 0.3, 0.6):
        for share in (0.0, 0.5, 0.95):
            t = time.perf_counter()
            res = replay(routing, frac * full, share)
            dt = time.perf_counter() - t
            print(f"{frac:>6.0%} {share:>6g} {res.hit_rate:>9.1%} {n_lookups / dt / 1e6:>12.2f}")
    sizes = [f * full for f in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)]
    model = TimeModel(base=20.0, up=100.0, cpu=300.0)
    print()
    for workers in (1, 2):
        t = time.perf_counter()
        predict_rows(routing, sizes, model, workers=workers)
        dt = time.perf_counter() - t
        n = len(sizes) * len(TABLE_SHARES) * n_lookups
        print(
            f"table {len(sizes)} sizes x {len(TABLE_SHARES)} shares, {workers} process(es): {dt:.1f} s, "
            f"{n / dt / 1e6:.2f} M lookups/s"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
