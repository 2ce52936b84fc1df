"""One decode token's attention over its cached positions (the core between the projections), per layout.

    python bench/decode_attention.py [--heads 32] [--kv-heads 4] [--dim 64] [--layers 12] [--positions 528]

Runs `layer_halves.decode_attention` for `layers` layers of a cache holding `positions` positions,
with the cache laid out head-major (`nn.layers.head_major`, what a model makes) and position-major
(the same numbers as [position, KV head, dim] in memory, read through a transposed view), in
alternating rounds in one process. "warm": the layers' caches stay in the CPU's caches between
tokens; "from memory": a 256 MiB read between tokens pushes them out, as a decode step's weights
do. Prints ms per token (all layers) and the caches' GB/s, the CPU and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_overhead import cpu_name
from moechat.engine.kernels.attention_core import LANES
from moechat.engine.kernels.layer_halves import decode_attention
from moechat.engine.loader import set_threads
from moechat.engine.nn.layers import LayerCache, Rope, head_major, host_heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--positions", type=int, default=528)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    set_threads(a.threads)
    n_ctx, pos = a.positions + 64, a.positions
    gen = torch.Generator().manual_seed(0)
    rope = Rope(a.dim, 10000.0, n_ctx, neox=True)
    layouts: dict[str, list[LayerCache]] = {"head-major": [], "position-major": []}
    for _ in range(a.layers):
        k, v = (
            torch.randn(n_ctx, a.kv_heads, a.dim, generator=gen),
            torch.randn(n_ctx, a.kv_heads, a.dim, generator=gen),
        )
        hm = LayerCache(head_major(n_ctx, a.kv_heads, a.dim), head_major(n_ctx, a.kv_heads, a.dim))
        hm.k.copy_(k)
        hm.v.copy_(v)
        layouts["head-major"].append(hm)
        layouts["position-major"].append(LayerCache(k.clone(), v.clone()))
    q = torch.randn(a.heads, a.dim, generator=gen).numpy()
    kv = torch.randn(a.kv_heads, a.dim, generator=gen).numpy()
    flush = np.ones(64 << 20, np.float32)  # 256 MiB

    def token(caches: list[LayerCache], cold: bool) -> float:
        if cold:
            flush.sum()
        t = time.perf_counter()
        for c in caches:
            decode_attention(q.copy(), kv.copy(), kv.copy(), rope.parts(), True, *host_heads(c), pos, 0, a.dim**-0.5)
        return time.perf_counter() - t

    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(a.rounds):
        for name, caches in layouts.items():
            for from_memory in (False, True):
                token(caches, from_memory)
                times.setdefault((name, from_memory), []).append(
                    statistics.median(token(caches, from_memory) for _ in range(15))
                )
    kv_bytes = a.layers * (pos + 1) * a.kv_heads * a.dim * 4 * 2
    print(f"CPU: {cpu_name()}; vector loops of {LANES} floats; {a.threads} threads")
    print(f"{a.layers} layers, {a.heads} heads, {a.kv_heads} KV heads, head dim {a.dim}, {pos + 1} positions: "
          f"{kv_bytes / 1e6:.1f} MB of keys and values a token")  # fmt: skip
    print("\n| layout | warm: ms a token | GB/s | from memory: ms a token | GB/s |\n|---|---:|---:|---:|---:|")
    for name in layouts:
        warm, cold = statistics.median(times[name, False]), statistics.median(times[name, True])
        print(f"| {name} | {warm * 1e3:.3f} | {kv_bytes / warm / 1e9:.1f} | {cold * 1e3:.3f} | "
              f"{kv_bytes / cold / 1e9:.1f} |")  # fmt: skip
    print(f"\nload average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
