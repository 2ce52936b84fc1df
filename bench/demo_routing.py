"""Does the demo route like a real MoE? Skew, reuse and cacheability of its expert selections.

    python bench/demo_routing.py [--tokens 1200]

Generates from a few prompts with the built-in demo, records the routing of every decode step
(the cache's trace), and prints per layer: the share of selections served by the top 20% of
experts, the share of selections whose expert was also selected in the previous 8 tokens, and
the hit rate of an LRU cache holding half of the layer's experts, next to what uniformly random
routing gives. Also prints the demo's decode speed (CPU device).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from moechat.app.paths import app_paths
from moechat.demo.build import ensure_demo
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.cache.trace import read_trace
from moechat.engine.events import SamplingParams, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import load_model
from moechat.tuner.routing_stats import lru_hit_rate, reuse_rate, top_share

PROMPTS = [
    "The old bridge over the river was built",
    "Here is a short story about a cat who",
    "The three most important inventions of the last century are",
    "Dear Sir, I am writing to complain about",
    "To make a good cup of tea, you should",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1200, help="decode tokens in all")
    ap.add_argument("--trace", type=Path, default=None, help="keep the routing trace here")
    ap.add_argument("--analyse", type=Path, default=None, help="only analyse this recorded trace")
    args = ap.parse_args()
    if args.analyse:
        tr = read_trace(args.analyse)
        steps: dict[int, list[list[int]]] = {}
        for rec in tr:
            if rec.n_tokens == 1:
                steps.setdefault(rec.layer, []).append(list(rec.ids))
        report(steps, tr.header["groups"][0]["n_expert"], tr.header["n_expert_used"], "recorded trace")
        return
    path = ensure_demo(app_paths().cache)
    per_prompt = args.tokens // len(PROMPTS)
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace or Path(tmp) / "demo.trace"
        # A cache of one slot per layer group is enough to record the trace; routing does not depend on it.
        lm = load_model(path, n_ctx=per_prompt + 64, cache=CacheSettings(mib=8, trace=trace))
        n_expert, k = lm.config.n_expert, lm.config.n_expert_used
        steps = {}
        t0, n_dec = time.perf_counter(), 0
        for i, prompt in enumerate(PROMPTS):
            params = SamplingParams(temperature=0.7, top_p=0.95, seed=i)
            events = generate(lm.model, lm.tokenizer, lm.chat_prompt(prompt), lm.new_cache(),
                              max_tokens=per_prompt, params=params, ignore_eos=True)  # fmt: skip
            n_dec += sum(1 for e in events if isinstance(e, TokenEvent) and e.token >= 0)
        tps = n_dec / (time.perf_counter() - t0)
        lm.close()
        for rec in read_trace(trace):
            if rec.n_tokens == 1:  # decode steps only
                steps.setdefault(rec.layer, []).append(list(rec.ids))
    report(steps, n_expert, k, f"{n_dec} decode tokens, {tps:.1f} t/s (prompts included)")


def report(steps: dict[int, list[list[int]]], n_expert: int, k: int, what: str) -> None:
    rng = random.Random(0)
    print(f"demo: {n_expert} experts per layer, {k} per token; {what}\n")
    print("| layer | top 20% experts' share | reused within 8 tokens (uniform) | LRU hit rate, half cached (uniform) |")
    print("|---:|---:|---:|---:|")
    sums = [0.0] * 5
    for layer in sorted(steps):
        sel = steps[layer]
        uniform = [rng.sample(range(n_expert), k) for _ in sel]  # what uniformly random routing gives
        row = (top_share(sel, n_expert), reuse_rate(sel), reuse_rate(uniform), lru_hit_rate(sel, n_expert // 2),
               lru_hit_rate(uniform, n_expert // 2))  # fmt: skip
        for j, v in enumerate(row):
            sums[j] += v
        print(f"| {layer} | {row[0]:.0%} | {row[1]:.0%} ({row[2]:.0%}) | {row[3]:.0%} ({row[4]:.0%}) |")
    m = [v / len(steps) for v in sums]
    print(f"| mean | {m[0]:.0%} | {m[1]:.0%} ({m[2]:.0%}) | {m[3]:.0%} ({m[4]:.0%}) |")


if __name__ == "__main__":
    main()
