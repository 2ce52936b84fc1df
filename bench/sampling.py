"""Sampling one token from a step's logits on the CPU: the sampler against the whole-vocabulary form.

    python bench/sampling.py [--vocab 32771 151936 262144] [--rounds 5]

"whole vocabulary" is the arithmetic `engine.sampling` defines, done as the sampler did it before it
looked for the top-k candidates first: a clone, top-k masking, a softmax, a sort and a cumulative sum
over every logit, in torch. Both run on the same logits in alternating rounds in one process, with
the default sampling parameters and greedy. Prints microseconds per token, the CPU and the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_overhead import cpu_name
from moechat.engine.events import GREEDY, SamplingParams
from moechat.engine.sampling import sample


def whole_vocabulary(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    logits = logits.float().clone()
    if p.temperature <= 0:
        return int(logits.argmax())
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0
    if p.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = sorted_p.cumsum(0)
        probs[order[cum - sorted_p > p.top_p]] = 0
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def per_call_us(f: Callable[[], int], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32771, 151936, 262144])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)  # as a decode step samples (generate.one_torch_thread)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for v in a.vocab:
        logits = torch.randn(v, generator=gen) * 3
        for name, p in (("default", SamplingParams()), ("greedy", GREEDY)):
            n = 50 if name == "default" else 200
            times: dict[str, list[float]] = {"sampler": [], "whole": []}
            for _ in range(a.rounds):
                times["sampler"].append(per_call_us(partial(sample, logits, p, (), gen), n))
                times["whole"].append(per_call_us(partial(whole_vocabulary, logits, p, gen), n))
            ours, whole = statistics.median(times["sampler"]), statistics.median(times["whole"])
            rows.append(f"| {v} | {name} | {ours:.0f} | {whole:.0f} | {whole / ours:.1f}x |")
    print(f"CPU: {cpu_name()}; torch on 1 thread")
    print("\n| vocabulary | parameters | sampler: us a token | whole vocabulary: us | ratio |")
    print("|---:|---|---:|---:|---:|")
    print("\n".join(rows))
    print(f"\nload average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
