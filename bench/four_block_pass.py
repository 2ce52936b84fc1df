"""The int8 dot products' four-block pass (`qblocks.QuadBlock`, AVX-512) against the per-block path, side by side.

    python bench/four_block_pass.py [--threads 2] [--rounds 7]

For each type that has a four-block pass (Q4_0, Q4_1, MXFP4), one token's products with a matrix
of the file's layout, compiled twice in one process: the type's layout with its four-block pass
and without it. Shapes: SmolLM2's output head (49152 rows of 576), a 4096-row matrix of rows of
6912, and SmolLM2's FFN gate (1536 rows of 576). Each matrix stays in the CPU's caches between
calls (the products' own speed, not the memory's). Prints GB/s of each path and their ratio,
alternating the two paths `--rounds` times (best of each), and the largest difference of the two
results relative to the largest output (float32 sums in another order).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_overhead import cpu_name
from moechat.engine.kernels import isa, qblocks
from moechat.engine.kernels.jit import njit, prange, set_kernel_threads
from testkit.ggufgen import quantized

SHAPES = ((49152, 576), (4096, 6912), (1536, 576))


def products(dot: Any, per_block: int) -> Any:
    """A kernel: out = w @ x for one int8-quantized row x, 16 rows a work item (as the engine's kernels)."""

    @njit(parallel=True)
    def run(w, x, rows, out, reps):  # numba: no annotations
        k = x.shape[1]
        for _ in range(reps):
            xq, dx, bs = qblocks.quantize_rows(x, rows, 8)
            for j in prange(w.shape[0] // 16):
                for r in range(j * 16, j * 16 + 16):
                    out[r] = dot(w, r * w.strides[0], k // per_block, xq, dx, bs, 0)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    set_kernel_threads(args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; CPU: {cpu_name()}; {args.threads} threads\n")
    quads = {t: lay for t, lay in qblocks.LAYOUTS.items() if lay.quad is not None}
    if not quads or not isa.AVX512:
        print("no four-block pass on this CPU (AVX-512 only)")
        return
    print("| type | rows x width | four blocks a pass GB/s | block by block GB/s | ratio | largest difference |")
    print("|---|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for qtype, layout in quads.items():
        kernels = [products(qblocks._dot_intrinsic(lay, 1, 8), layout.weights)
                   for lay in (layout, dataclasses.replace(layout, quad=None))]  # fmt: skip
        for n, k in SHAPES:
            w = quantized((n, k), qtype, rng)
            x = rng.standard_normal((1, k)).astype(np.float32)
            rows = np.zeros(1, np.int64)
            outs = [np.empty(n, np.float32) for _ in kernels]
            for f, out in zip(kernels, outs, strict=True):
                f(w, x, rows, out, 1)
            diff = float(np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max())
            reps = max(1, int(3e7 // w.nbytes))
            best = [float("inf")] * len(kernels)
            for _ in range(args.rounds):
                for i, (f, out) in enumerate(zip(kernels, outs, strict=True)):
                    t = time.perf_counter()
                    f(w, x, rows, out, reps)
                    best[i] = min(best[i], (time.perf_counter() - t) / reps)
            quad, block = (w.nbytes / b / 1e9 for b in best)
            print(f"| {qtype.name} | {n} x {k} | {quad:.1f} | {block:.1f} | {quad / block:.2f}x | {diff:.1e} |",
                  flush=True)  # fmt: skip
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
