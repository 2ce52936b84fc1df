"""One decode token split into its parts, with the bytes each reads and the machine's read bandwidth.

    python bench/decode_parts.py MODEL.gguf [--tokens 32] [--threads 0] [--kernels fast] [--context 512]

In-process, after warm-up tokens (no page faults left), cache off: per decode token, the time of
the attention blocks (norm, projections, rotary, cache, attention, output projection), of the MoE
layers (router and the selected experts, shared experts included) and dense FFNs, and of the output
head; the weight bytes each reads per token (the MoE layers: the router and the experts the token
selected) and so its GB/s. The machine's read bandwidth is measured in the same run (a compiled
sum over 1 GiB, on the same threads), so the parts can be read as a share of it. Prints the CPU
and the kernels' instruction path. With --context the cache first holds that many positions: the
attention then also reads them (not counted in its bytes).

The parts are timed on the model's decode plan (models.decode_plan) with each layer's two halves
called one by one from Python and timed. Tokens alternate with the plan as it runs by default,
where a range of layers that are all two compiled calls runs them back to back: its step time is
printed beside the timed one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_overhead import PROMPT, cpu_name
from moechat.engine.generate import decode_one, prefill
from moechat.engine.loader import load_model, set_threads
from moechat.engine.models.decode_plan import DecodePlan
from moechat.engine.models.decoder import DenseFFN, MoeFFN


def read_bandwidth(n_threads: int, n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of reading `n_bytes` (numpy sums, which run without the GIL, one slice per thread), best of `repeats`."""
    a = np.ones(n_bytes // 4, np.float32)
    parts = np.array_split(a, n_threads)
    with ThreadPoolExecutor(n_threads) as pool:

        def read() -> None:
            list(pool.map(np.sum, parts))

        read()
        best = min(_timed(read) for _ in range(repeats))
    return n_bytes / best / 1e9


def _timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _nbytes(obj: Any) -> int:
    """Bytes of a weight as the kernels read it (a quantized matrix's file bytes, a tensor's storage)."""
    raw = getattr(obj, "raw", None)
    if raw is not None:
        return int(raw.nbytes) if isinstance(raw, np.ndarray) else int(raw.numel() * raw.element_size())
    if isinstance(obj, torch.Tensor):
        return int(obj.numel() * obj.element_size())
    return 0


def _module_bytes(m: Any) -> int:
    """Bytes of every weight of module m (tensors and quantized matrices among its attributes)."""
    total, seen = 0, set()
    for mod in m.modules():
        for v in vars(mod).values():
            if id(v) not in seen and (hasattr(v, "raw") or isinstance(v, torch.Tensor)):
                seen.add(id(v))
                total += _nbytes(v)
        for p in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            if id(p) not in seen:
                seen.add(id(p))
                total += _nbytes(p)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--kernels", default="fast")
    ap.add_argument("--context", type=int, default=0,
                    help="positions in the cache before the timed tokens (0: the short prompt only)")  # fmt: skip
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    n_threads = set_threads(args.threads)
    print(f"CPU: {cpu_name()}; {n_threads} threads; kernels {args.kernels}; load average {os.getloadavg()[0]:.2f}")
    bw = read_bandwidth(n_threads)
    lm = load_model(args.model, n_ctx=max(args.context, 80) + 2 * args.tokens + 16, cpu_kernels=args.kernels)
    model = lm.model
    kv = lm.new_cache()
    ids = lm.tokenizer.encode(PROMPT)
    if args.context:  # the prompt again and again, to that many positions
        ids = (ids * (args.context // len(ids) + 1))[: args.context]
    tok = int(prefill(model, ids, kv).argmax())
    for _ in range(16):  # warm-up: every page touched, every kernel compiled
        tok = int(decode_one(model, tok, kv).argmax())

    spent: dict[str, float] = defaultdict(float)
    read: dict[str, int] = defaultdict(int)
    host = getattr(model, "host_experts", None)

    depth: dict[str, int] = defaultdict(int)
    kind = (kv.device.type, kv.layers[0].k.dtype)

    timing = [False]  # the parts are counted on the per-part path's tokens only

    def wrap(name: str, f: Callable[..., Any], nbytes: Callable[..., int]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            if not timing[0]:
                return f(*a, **kw)
            depth[name] += 1  # a part's method may call another of its wrapped methods: count the outer one
            t = time.perf_counter()
            try:
                r = f(*a, **kw)
            finally:
                depth[name] -= 1
            if depth[name] == 0:
                spent[name] += time.perf_counter() - t
                read[name] += nbytes(*a, r)
            return r

        return call

    layers = []
    for block, p in zip(model.blocks, DecodePlan.build(model, kind).layers, strict=True):
        attn_bytes = _module_bytes(block.attn)
        attention = wrap("attention", p.attention, lambda *a, b=attn_bytes: b)
        ffn = block.ffn
        if isinstance(ffn, MoeFFN):
            fixed = _module_bytes(ffn)  # router and shared experts; the routed ones are counted per token

            def moe_bytes(*a: Any, ffn: MoeFFN = ffn, fixed: int = fixed) -> int:
                lx = host.layers[ffn.i] if host is not None else None
                n_sel = len(set(ffn.last_ids.reshape(-1).tolist()))
                return fixed + (n_sel * lx.bytes_per_expert if lx is not None else 0)

            half = wrap("MoE layers", p.ffn, moe_bytes)
        else:
            dense = _module_bytes(ffn) if isinstance(ffn, DenseFFN) else 0
            half = wrap("dense FFNs", p.ffn, lambda *a, b=dense: b)
        layers.append(dataclasses.replace(p, attention=attention, ffn=half, calls=None))  # one by one, timed
    timed = DecodePlan(model, layers)
    default = model.decode_plan(kv)
    head_bytes = _nbytes(model.output) + _nbytes(model.norm)
    model.head = wrap("output head", model.head, lambda *a: head_bytes)

    steps: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.tokens):
        for whole in (True, False):
            model._plans[kind] = default if whole else timed
            timing[0] = not whole
            t = time.perf_counter()
            tok = int(decode_one(model, tok, kv).argmax())
            steps[whole].append(time.perf_counter() - t)
    lm.close()
    n = args.tokens
    step = statistics.mean(steps[False])  # the parts are means too: "the rest" is what they leave
    whole_step = statistics.mean(steps[True])
    print(f"machine read bandwidth: {bw:.1f} GB/s; decode {1 / step:.1f} t/s per part (mean step {step * 1e3:.2f} "
          f"ms), {1 / whole_step:.1f} t/s as the plan runs by default ({whole_step * 1e3:.2f} ms), alternating "
          f"tokens at positions {len(ids) + 16}-{len(ids) + 16 + 2 * n}\n")  # fmt: skip
    print("| part | MB read per token | ms per token | GB/s | of the read bandwidth |")
    print("|---|---:|---:|---:|---:|")
    for name in ("attention", "MoE layers", "dense FFNs", "output head"):
        if name not in spent:
            continue
        ms, mb = spent[name] / n * 1e3, read[name] / n / 1e6
        gbs = mb / ms if ms else 0.0
        print(f"| {name} | {mb:.0f} | {ms:.2f} | {gbs:.1f} | {100 * gbs / bw:.0f}% |")
    rest = step * 1e3 - sum(spent.values()) / n * 1e3
    print(f"| the rest (embedding, sampling, Python) | - | {rest:.2f} | - | - |")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
