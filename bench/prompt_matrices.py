"""A prompt's dense matrices: the kernels' integer tiles against decoding to float for torch's GEMM.

    python bench/prompt_matrices.py [--tokens 512] [--threads 2] [--rounds 6]

For each matrix (quant type, rows x columns) and a prompt of --tokens rows of activations: GOP/s of
`cpu_kernels.dense` (the tiles for super-block types, the four-token passes for the others) and of
`QLinear`'s float path (tiles of rows decoded in parallel, then torch's GEMM), alternating in one
process, the median of --rounds runs each. The engine takes the tiles where `QLinear.tiled` says.
Widths 2048 and 2064 side by side: output rows a power of two apart once slowed the tiles by 1.6x.
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
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_overhead import cpu_name
from moechat.engine.kernels import cpu as cpu_kernels
from moechat.engine.kernels.jit import set_kernel_threads
from moechat.engine.nn.qlinear import QLinear
from testkit.ggufgen import quantized

MATRICES = [(Q.Q4_K, 4096, 2048), (Q.Q4_K, 2048, 4096), (Q.Q4_K, 512, 2048), (Q.Q6_K, 2048, 768),
            (Q.Q6_K, 2064, 768), (Q.Q8_0, 4096, 2880), (Q.Q8_0, 512, 2880)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    set_kernel_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_name()}; {args.threads} threads, {args.tokens} tokens; load average {os.getloadavg()[0]:.2f}")
    print("\n| type | rows x cols | tiles GOP/s | decode + GEMM GOP/s | tiles / GEMM | the engine takes |")
    print("|---|---|---:|---:|---:|---|")
    for qtype, n, k in MATRICES:
        raw = quantized((n, k), qtype, rng)
        x = rng.standard_normal((args.tokens, k)).astype(np.float32)
        lin = QLinear(raw, qtype)
        xt = torch.from_numpy(x)
        runs: dict[str, list[float]] = {"tiles": [], "gemm": []}
        for r in range(args.rounds + 1):
            for name in ("tiles", "gemm"):
                t = time.perf_counter()
                if name == "tiles":
                    cpu_kernels.dense(raw, qtype, x)
                else:
                    lin.gemm(xt)  # the float path, whatever the type
                if r:  # the first round compiles and warms
                    runs[name].append(time.perf_counter() - t)
        ops = 2 * n * k * args.tokens
        tiles, floats = (ops / statistics.median(runs[v]) / 1e9 for v in ("tiles", "gemm"))
        print(f"| {qtype.name} | {n} x {k} | {tiles:.0f} | {floats:.0f} | {tiles / floats:.2f} | "
              f"{'tiles' if lin.tiled else 'GEMM'} |")  # fmt: skip
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
