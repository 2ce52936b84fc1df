"""CPU kernel speed per quant type: GB/s of the file's bytes read per second, against RAM bandwidth.

    python bench/kernels.py [--threads N] [--mib 384] [--tokens 1] [--types Q4_K,Q8_0] [--no-exact]

Cold cache: each measurement cycles through enough distinct matrices (--mib of quantized bytes)
that none is in the CPU caches when it is read. Rows:
  fast     engine/cpu_kernels.dense: the blocks read in place, int16 activations (the default)
  int8     the same with int8 activations (--cpu-kernels int8)
  moe      engine/fused_moe.run_fused: a layer of 128 experts, 8 selected (Qwen3-30B-A3B shapes),
           gate+up+down in three calls; GB/s of the selected experts' bytes (moe int8: int8 activations)
  exact    the reference path: dequantize with torch, then x @ W.T (--cpu-kernels exact)
The RAM figure is numpy summing a 1 GiB array on as many threads as the kernels use.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_overhead import cpu_name
from moechat.engine.gguf.dequant import dequantize
from moechat.engine.kernels import cpu as cpu_kernels
from moechat.engine.kernels.jit import set_kernel_threads
from moechat.engine.moe.expert_tensors import ExpertTensor, LayerExperts
from moechat.engine.moe.kernel_calls import run_fused
from testkit.ggufgen import quantized

TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.IQ4_XS)
SHAPES = {"768x2048 (Qwen3-30B-A3B expert)": (768, 2048), "2048x768 (its down)": (2048, 768),
          "14336x4096 (Mixtral expert)": (14336, 4096)}  # fmt: skip


def ram_bandwidth(threads: int) -> float:
    """GB/s of numpy summing 1 GiB, split over `threads` threads (numpy's sum releases the GIL)."""
    a = np.ones(2**28, np.float32)
    parts = np.array_split(a, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(4):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def timed(fn: Callable[[int], object], n: int, bytes_each: int, seconds: float = 1.5) -> float:
    """GB/s over the best of three windows: on a shared machine, the others hold the neighbours' noise."""
    fn(0)
    best = 0.0
    for _ in range(3):
        i, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3 or i < n:
            fn(i % n)
            i += 1
        best = max(best, i * bytes_each / (time.perf_counter() - t0) / 1e9)
    return best


def _dense(raws: list[np.ndarray], qtype: Q, x: np.ndarray, bits: int, i: int) -> np.ndarray:
    return cpu_kernels.dense(raws[i], qtype, x, bits)


def measure(
    qtype: Q, n_rows: int, k: int, mib: int, tokens: int, rng: np.random.Generator, exact: bool
) -> list[tuple[str, float]]:
    block, size = GGML_QUANT_SIZES[qtype]
    if k % block:
        return []
    mat_bytes = n_rows * k // block * size
    n = max(2, mib * 2**20 // mat_bytes)
    raws = [quantized((n_rows, k), qtype, rng) for _ in range(n)]
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    rows = [(name, timed(functools.partial(_dense, raws, qtype, x, bits), n, mat_bytes))
            for name, bits in (("fast", 16), ("int8", 8))]  # fmt: skip
    if exact:
        xt = torch.from_numpy(x)
        rows.append(("exact", timed(lambda i: xt @ dequantize(raws[i], qtype).T, min(n, 8), mat_bytes, 0.5)))
    return rows


def measure_moe(qtype: Q, mib: int, rng: np.random.Generator, bits: int) -> float:
    """A Qwen3-30B-A3B MoE layer at decode: 8 of 128 experts (2048 hidden, 768 FFN), all in `qtype`."""
    e, f, n_expert, k = 2048, 768, 128, 8
    layer_bytes = 3 * n_expert * f * e // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
    layers = []
    for _ in range(max(2, mib * 2**20 // layer_bytes)):
        g, u, d = (torch.from_numpy(quantized((n_expert, *s), qtype, rng)) for s in ((f, e), (f, e), (e, f)))
        layers.append(LayerExperts(ExpertTensor(g, qtype), ExpertTensor(u, qtype), ExpertTensor(d, qtype)))
    x = rng.standard_normal((1, e)).astype(np.float32)
    w = np.full((1, k), 1 / k, np.float32)
    contrib = np.empty((k, e), np.float32)

    def step(i: int) -> None:
        lx = layers[i]
        ids = rng.choice(n_expert, k, replace=False).astype(np.int64)[None]
        run_fused(lx, (lx.gate.raw.numpy(), lx.up.raw.numpy(), lx.down.raw.numpy()), None, 0, x, ids, w,
                  sorted(ids[0].tolist()), contrib, (bits, bits))  # fmt: skip
        cpu_kernels.sum_by_token(contrib, ids)

    return timed(step, len(layers), layers[0].bytes_per_expert * k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--mib", type=int, default=384, help="quantized bytes cycled through per measurement")
    ap.add_argument("--tokens", type=int, default=1, help="activation rows per call (1: decode)")
    ap.add_argument("--types", default=",".join(t.name for t in TYPES), help="quant types, comma-separated")
    ap.add_argument("--no-exact", action="store_true", help="skip the exact path (slow)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    set_kernel_threads(args.threads)
    rng = np.random.default_rng(0)
    bw = ram_bandwidth(args.threads)
    load = os.getloadavg()
    print(f"CPU: {cpu_name()}")
    print(f"RAM read bandwidth (numpy sum over 1 GiB, {args.threads} thread(s)): {bw:.1f} GB/s; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.tokens} token(s) per call\n")  # fmt: skip
    print("| type | shape | path | GB/s | of RAM |")
    print("|---|---|---|---|---|")
    for qtype in (Q[name] for name in args.types.split(",")):
        for label, (n_rows, k) in SHAPES.items():
            for path, gbs in measure(qtype, n_rows, k, args.mib, args.tokens, rng, not args.no_exact):
                print(f"| {qtype.name} | {label} | {path} | {gbs:.2f} | {100 * gbs / bw:.0f}% |", flush=True)
        for path, bits in (("moe", 16), ("moe int8", 8)) if args.tokens == 1 else ():
            gbs = measure_moe(qtype, args.mib, rng, bits)
            print(f"| {qtype.name} | MoE layer, 8 of 128 experts | {path} | {gbs:.2f} | {100 * gbs / bw:.0f}% |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
