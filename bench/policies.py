"""Cache policies against Belady's MIN: misses on held-out routing, at 1x to 4x top-k slots per layer.

    python bench/policies.py [--tokens 1024] [--demo smollm2 gemma] [--synthetic-tokens 3000]

Routing comes from the built-in demos (prompts the tests and the tuner do not use; decode steps
recorded as the engine's trace) and from generated traces with known skew: Zipf over each
layer's experts, and the same with drift (the popularity ranking shifts every 400 tokens). Each
policy replays the whole trace through the engine's own cache code (CPU share 0, equal slots);
only the second half is scored, the first warms the cache. The table gives misses relative to
MIN with bypass (the offline optimum when a miss may stay uncached, as the CPU path allows) and,
per policy, how many fewer misses than ClassLRU it has.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

from moechat.engine.cache.policy import POLICIES
from moechat.tuner.baselines import simulate_baseline
from moechat.tuner.simulator import Group, Routing, load_routing, replay

# Prompts no test or tuner run uses: the demos' routing on them is held out.
PROMPTS = [
    "Write a short letter to a neighbour about a lost umbrella.",
    "What should I pack for three days of hiking in the mountains?",
    "Explain how a bicycle gear works to a ten year old.",
    "Give me a recipe for a simple vegetable soup.",
    "Why do leaves change colour in autumn?",
    "Describe the view from a lighthouse at night.",
    "List some ways to save water at home.",
    "Tell me a story about a robot who learns to paint.",
]


def demo_trace(name: str, tokens: int, out: Path) -> Routing:
    from moechat.app.paths import app_paths
    from moechat.app.settings import DEMO_DEFAULTS
    from moechat.demo.build import ensure_demo
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.events import SamplingParams
    from moechat.engine.generate import generate
    from moechat.engine.loader import load_model

    path = ensure_demo(app_paths().cache, name=name)
    per = max(16, tokens // len(PROMPTS))
    demo = DEMO_DEFAULTS[name]
    lm = load_model(path, n_ctx=per + 128, cache=CacheSettings(mib=demo["moe_cache_mib"], trace=out))
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=1,
                            repeat_penalty=demo.get("repeat_penalty", 1.0))  # fmt: skip
    try:
        for prompt in PROMPTS:
            for _ in generate(lm.model, lm.tokenizer, lm.chat_prompt(prompt), lm.new_cache(), max_tokens=per,
                              params=params, ignore_eos=True):  # fmt: skip
                pass
    finally:
        lm.close()
    return load_routing(out)


def synthetic(tokens: int, n_layers: int, n_expert: int, k: int, drift: bool, seed: int = 0) -> Routing:
    """Zipf(1) popularity per layer; with drift, each layer's ranking rotates by a quarter every 400 tokens."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) for r in range(n_expert)]
    ranks = [rng.sample(range(n_expert), n_expert) for _ in range(n_layers)]
    records = []
    for t in range(tokens):
        shift = (t // 400) * (n_expert // 4) if drift else 0
        for layer in range(n_layers):
            order = ranks[layer][shift % n_expert :] + ranks[layer][: shift % n_expert]
            chosen: list[int] = []
            while len(chosen) < k:
                e = order[rng.choices(range(n_expert), weights)[0]]
                if e not in chosen:
                    chosen.append(e)
            records.append((layer, k, tuple(chosen)))
    return Routing((Group(tuple(range(n_layers)), n_expert, 1 << 20),), k, 32, tuple(records))


def table(name: str, routing: Routing, multiples: list[int]) -> list[str]:
    layers = len(routing.groups[0].layers)
    k = routing.n_expert_used
    warm = routing.n_tokens // 2
    lines = []
    for m in multiples:
        slots = [min(layers * m * k, layers * routing.groups[0].n_expert)]
        best = simulate_baseline(routing, slots, "min-bypass", warmup=warm).misses
        misses = {p: replay(routing, 0, 0.0, warmup=warm, n_slots=slots, policy=p).total.misses for p in POLICIES}

        cells = " | ".join(_cell(misses[p], best, misses["classlru"], p == "classlru") for p in POLICIES)
        lines.append(f"| {name} | {m}x top-k ({slots[0] // layers}/layer) | {best} | {cells} |")
    return lines


def _cell(misses: int, best: int, base: int, is_base: bool) -> str:
    fewer = "" if is_base else f" ({100 * (base - misses) / max(base, 1):+.1f}%)"
    return f"{misses / max(best, 1):.2f}x{fewer}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="decode tokens per demo, all prompts")
    ap.add_argument("--demo", nargs="*", default=["smollm2", "gemma"])
    ap.add_argument("--synthetic-tokens", type=int, default=3000)
    ap.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--traces", type=Path, default=None, help="keep the demos' traces here (reused if present)")
    args = ap.parse_args()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; the second half of each trace is scored\n")
    print("| routing | slots | MIN-bypass misses | " + " | ".join(POLICIES) + " |")
    print("|---|---|---|" + "---|" * len(POLICIES))
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.demo:
            trace = (args.traces or Path(tmp)) / f"{name}-{args.tokens}.trace"
            routing = load_routing(trace) if trace.exists() else demo_trace(name, args.tokens, trace)
            for line in table(f"demo {name}", routing, args.multiples):
                print(line, flush=True)
    for drift in (False, True):
        routing = synthetic(args.synthetic_tokens, 8, 64, 4, drift)
        for line in table("Zipf + drift" if drift else "Zipf", routing, args.multiples):
            print(line, flush=True)


if __name__ == "__main__":
    main()
