"""Expert-cache benchmark: policy cost per lookup, and decode t/s across cache sizes, CPU shares and links.

    python bench/cache.py [--tokens 48] [--model MODEL.gguf]

1. Policy + bookkeeping: ClassLRU.plan() for one decode token of a layer with 128 experts, top-8,
   on skewed (Zipf) routing, at a cache of 30% of the experts.
2. Decode t/s with the CPU device at cache sizes of 10%, 30% and 100% of the expert bytes, CPU
   shares 0 / 0.5 / 0.95, with and without an emulated 16 GB/s link; all arms in one process,
   interleaved, so the ratios compare like with like on a noisy machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.engine.cache.policy import ClassLRU, CpuShare
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.generate import decode_one, prefill
from moechat.engine.loader import load_model


def zipf_ids(rng: random.Random, n_expert: int, k: int, weights: list[float]) -> list[int]:
    chosen: set[int] = set()
    while len(chosen) < k:
        chosen.add(rng.choices(range(n_expert), weights)[0])
    return list(chosen)


def policy_cost(n_expert: int = 128, k: int = 8, n_layers: int = 4, steps: int = 4000) -> tuple[float, float]:
    rng = random.Random(0)
    weights = [1 / (i + 1) ** 0.8 for i in range(n_expert)]
    perms = [rng.sample(range(n_expert), n_expert) for _ in range(n_layers)]
    policy = ClassLRU(range(n_layers), n_expert, int(0.3 * n_layers * n_expert))
    share = CpuShare(0.5)
    lookups = [[perms[layer][e] for e in zipf_ids(rng, n_expert, k, weights)] for layer in range(n_layers)
               for _ in range(steps // n_layers)]  # fmt: skip
    t = time.perf_counter()
    for i, ids in enumerate(lookups):
        layer = i % n_layers
        policy.plan(layer, ids, 1, share.active())
    per_call = (time.perf_counter() - t) / len(lookups)
    return per_call * 1e6, len(lookups) * k / (time.perf_counter() - t)


def decode_tps(lm_path: Path, settings: CacheSettings | None, prompt: list[int], n_tokens: int) -> float:
    lm = load_model(lm_path, n_ctx=len(prompt) + n_tokens + 8, cache=settings)
    cache = lm.new_cache()
    tok = int(prefill(lm.model, prompt, cache).argmax())
    for _ in range(8):  # warm the cache before timing
        tok = int(decode_one(lm.model, tok, cache).argmax())
    t = time.perf_counter()
    for _ in range(n_tokens):
        tok = int(decode_one(lm.model, tok, cache).argmax())
    elapsed = time.perf_counter() - t
    lm.close()
    return n_tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a MoE GGUF (default: a generated 64-expert top-8 model)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)

    us, lookups_per_s = policy_cost()
    print("## Policy cost (ClassLRU.plan, 128 experts, top-8, 1 token, 30% cache, share 0.5)\n")
    print("| us per layer lookup | expert lookups/s |")
    print("|---:|---:|")
    print(f"| {us:.1f} | {lookups_per_s:,.0f} |\n")

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from testkit.ggufgen import tiny_moe

            path = tiny_moe(Path(tmp) / "bench.gguf", n_layers=4, n_embd=512, n_head=8, n_expert=64,
                            n_expert_used=8, n_ff_exp=256, n_vocab=1024)  # fmt: skip
        probe = load_model(path, n_ctx=64)
        expert_mib = sum(lx.bytes_per_expert * lx.gate.raw.shape[0] for lx in probe.model.host_experts.layers.values())
        expert_mib /= 2**20
        prompt = probe.tokenizer.encode("The history of the harbour town begins with the fishermen who")
        n_layers = probe.config.n_layers
        probe.close()

        arms: list[tuple[str, float, float, float]] = [("off", 0.0, 0.0, 0.0)]
        for frac in (0.1, 0.3, 1.0):
            for share in (0.0, 0.5, 0.95):
                for link in (0.0, 16.0):
                    arms.append((f"{int(frac * 100)}%", frac * expert_mib, share, link))
        results: dict[tuple[str, float, float], list[float]] = {}
        for _ in range(args.repeats):
            for label, mib, share, link in arms:
                settings = CacheSettings(mib=mib, cpu_share=share, emulate_link_gbps=link) if mib else None
                results.setdefault((label, share, link), []).append(decode_tps(path, settings, prompt, args.tokens))
        base = statistics.median(results[("off", 0.0, 0.0)])
        print(f"## Decode t/s, CPU device ({expert_mib:.0f} MiB of experts, {n_layers} layers)\n")
        print("| cache | share | link GB/s | t/s | vs off |")
        print("|---|---:|---:|---:|---:|")
        for (label, share, link), v in results.items():
            tps = statistics.median(v)
            print(f"| {label} | {share:g} | {link or '-'} | {tps:.1f} | {tps / base:.2f} |")
        step_ms = 1000 / base
        print(f"\nPolicy share of a decode step: {n_layers * us / 1000 / step_ms * 100:.2f}% "
              f"({n_layers} layers x {us:.1f} us of {step_ms:.1f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
