"""Can the next layer's experts be predicted early enough to upload them while this layer computes?

    python bench/prefetch.py [--demo smollm2] [--tokens 512] [--extra 0 1 2]

Decodes held-out prompts with a built-in demo and its default cache. At every decode step, after
block l, layer l+1's router is applied to block l's output (normalised with layer l+1's FFN
norm): its top k (+ `extra`) experts are the prediction; the experts layer l+1 then selects are
the truth. Per layer: recall (selected experts that were predicted) and precision. Then, with
the cache's own misses (the recorded trace replayed through ClassLRU), what prefetching would
move: misses predicted in time (their upload could start a layer early), wasted uploads
(predicted, not selected, not cached), and the link time hidden behind one layer's compute at
4 and 16 GB/s, with a layer's compute time taken from the measured decode speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from moechat.engine.cache.policy import ClassLRU, CpuShare, bypasses
from moechat.engine.models.decoder import MoeFFN
from moechat.engine.moe.routing import route
from moechat.engine.nn.layers import rms_norm

PROMPTS = [
    "Write a short letter to a neighbour about a lost umbrella.",
    "What should I pack for three days of hiking in the mountains?",
    "Explain how a bicycle gear works to a ten year old.",
    "Tell me a story about a robot who learns to paint.",
]


def main() -> None:
    from moechat.app.paths import app_paths
    from moechat.app.settings import DEMO_DEFAULTS
    from moechat.demo.build import ensure_demo
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.cache.trace import read_trace
    from moechat.engine.events import SamplingParams, TokenEvent
    from moechat.engine.generate import generate
    from moechat.engine.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", default="smollm2")
    ap.add_argument("--tokens", type=int, default=512, help="decode tokens in all")
    ap.add_argument("--extra", type=int, nargs="+", default=[0, 1, 2], help="experts predicted beyond top-k")
    ap.add_argument("--per-layer", action="store_true", help="also each layer's recall for top-k")
    ap.add_argument("--speed", action="store_true",
                    help="instead: decode t/s with and without --moe-cache-prefetch next-layer, emulated link at "
                         "4 and 16 GB/s, alternating runs")  # fmt: skip
    args = ap.parse_args()
    if args.speed:
        speed(args.demo, args.tokens)
        return
    demo = DEMO_DEFAULTS[args.demo]
    per = max(16, args.tokens // len(PROMPTS))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "run.trace"
        settings = CacheSettings(mib=demo["moe_cache_mib"], cpu_share=demo["moe_cache_cpu_share"], trace=trace)
        lm = load_model(ensure_demo(app_paths().cache, name=args.demo), n_ctx=per + 128, cache=settings)
        cfg, model = lm.config, lm.model
        blocks = list(model.blocks)
        k, widest = cfg.n_expert_used, cfg.n_expert_used + max(args.extra)
        step = {"decode": False, "token": -1}
        predicted: dict[tuple[int, int], list[int]] = {}  # (decode step, layer) -> experts, best first

        def hook(i: int):  # after block i: predict block i+1's experts
            nxt = blocks[i + 1].ffn if i + 1 < len(blocks) else None

            def fn(module: torch.nn.Module, inputs: object, out: torch.Tensor) -> None:
                if not step["decode"] or not isinstance(nxt, MoeFFN):
                    return
                h = rms_norm(out, blocks[i + 1].ffn_norm, cfg.norm_eps)
                logits = torch.nn.functional.linear(h, nxt.router, nxt.router_bias)
                wide = dataclasses.replace(cfg, n_expert_used=min(widest, cfg.n_expert))
                ids, _ = route(logits, wide, nxt.choice_bias)
                predicted[(step["token"], i + 1)] = ids[-1].tolist()

            return fn

        for i, b in enumerate(blocks):
            b.register_forward_hook(hook(i))
        params = SamplingParams(temperature=0.7, seed=1, repeat_penalty=demo.get("repeat_penalty", 1.0))
        n_tok, t_dec = 0, 0.0
        for prompt in PROMPTS:
            step["decode"] = False
            t0 = None
            for ev in generate(model, lm.tokenizer, lm.chat_prompt(prompt), lm.new_cache(), max_tokens=per,
                               params=params, ignore_eos=True):  # fmt: skip
                if isinstance(ev, TokenEvent):
                    if t0 is None:
                        t0 = time.perf_counter()  # decode steps follow the first token
                    else:
                        n_tok += 1
                    step["decode"] = True
                    step["token"] += 1
            t_dec += time.perf_counter() - (t0 or time.perf_counter())
        lm.close()
        tr = read_trace(trace)
    g = tr.header["groups"][0]
    moe_layers = sorted({layer for grp in tr.header["groups"] for layer in grp["layers"]})
    layer_s = t_dec / max(n_tok, 1) / len(blocks)  # hooks included: a slight overestimate of compute
    # The decode records in order: token t's records follow its first layer's.
    decode = [r for r in tr if r.n_tokens == 1]
    policy = ClassLRU(g["layers"], g["n_expert"], g["n_slots"])
    share = CpuShare(tr.header["cpu_share"])
    recall: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    moved = {e: {"miss": 0, "in_time": 0, "wasted": 0} for e in args.extra}
    t = -1
    for rec in tr:
        if rec.layer == moe_layers[0] and rec.n_tokens == 1:
            t += 1
        if bypasses(rec.n_tokens, rec.n_used, g["n_expert"], g["n_slots"], tr.header["max_batch"]):
            continue
        plan = policy.plan(rec.layer, rec.ids, rec.n_tokens, share.active())
        pred = predicted.get((t, rec.layer)) if rec.n_tokens == 1 else None
        if pred is None:
            continue
        truth = set(rec.ids)
        misses = {e for e, _ in plan.uploads} | set(plan.cpu)
        for extra in args.extra:
            p = set(pred[: k + extra])
            recall[extra][rec.layer].append(len(p & truth) / len(truth))
            moved[extra]["miss"] += len(misses)
            moved[extra]["in_time"] += len(p & misses)
            moved[extra]["wasted"] += len(p - truth - set(plan.hits))  # uploads nobody reads this step
    print(
        f"{args.demo} demo: {n_tok} decode tokens over {len(decode) // max(len(moe_layers), 1)} steps, "
        f"{len(moe_layers)} MoE layers, top-{k} of {cfg.n_expert}; cache {g['n_slots']} slots, "
        f"{len(blocks)} blocks, {layer_s * 1e3:.2f} ms a block; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        "\n| predicted | recall (mean) | worst layer | best layer | precision | misses predicted in time | "
        "wasted uploads / step | link hidden at 4 GB/s | at 16 GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    steps = max(t + 1, 1)
    for extra in args.extra:
        per_layer = {layer: sum(v) / len(v) for layer, v in recall[extra].items() if v}
        mean = sum(per_layer.values()) / max(len(per_layer), 1)
        worst, best = min(per_layer.items(), key=lambda kv: kv[1]), max(per_layer.items(), key=lambda kv: kv[1])
        m = moved[extra]
        hidden = []
        for gbps in (4, 16):
            link = m["in_time"] * g["expert_bytes"] / (gbps * 1e9)  # seconds of uploads that could start early
            total = m["miss"] * g["expert_bytes"] / (gbps * 1e9)
            # Each step's early uploads overlap at most one block's compute.
            per_step = min(link / steps / len(moe_layers), layer_s) * steps * len(moe_layers)
            hidden.append(f"{100 * per_step / total:.0f}%" if total else "-")
        print(
            f"| top-{k}+{extra} | {100 * mean:.1f}% | layer {worst[0]} {100 * worst[1]:.0f}% | layer {best[0]} "
            f"{100 * best[1]:.0f}% | {100 * mean * k / (k + extra):.1f}% | "
            f"{100 * m['in_time'] / max(m['miss'], 1):.1f}% | {m['wasted'] / steps:.1f} | {hidden[0]} | {hidden[1]} |"
        )
    if args.per_layer:
        per_layer_table(recall[args.extra[0]])


def speed(name: str, tokens: int, repeats: int = 3) -> None:
    from moechat.app.paths import app_paths
    from moechat.app.settings import DEMO_DEFAULTS
    from moechat.demo.build import ensure_demo
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.events import GREEDY, DoneEvent
    from moechat.engine.generate import generate
    from moechat.engine.loader import load_model

    demo = DEMO_DEFAULTS[name]
    lm = load_model(ensure_demo(app_paths().cache, name=name), n_ctx=tokens + 128)
    prompt = lm.chat_prompt(PROMPTS[0])
    print(
        f"{name} demo, cache {demo['moe_cache_mib']:g} MiB, share {demo['moe_cache_cpu_share']:g}, {tokens} tokens "
        f"greedy, {repeats} alternating runs each; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
    )
    print("| link | t/s without | t/s with prefetch | ratio | prefetched / used per token |")
    print("|---|---|---|---|---|")
    for gbps in (4.0, 16.0):
        tps: dict[bool, list[float]] = {False: [], True: []}
        used = (0, 0, 1)
        for _ in range(repeats):
            for on in (False, True):
                lm.set_cache(CacheSettings(mib=demo["moe_cache_mib"], cpu_share=demo["moe_cache_cpu_share"],
                                           emulate_link_gbps=gbps, prefetch=on))  # fmt: skip
                for ev in generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=tokens, params=GREEDY,
                                   ignore_eos=True):  # fmt: skip
                    if isinstance(ev, DoneEvent):
                        tps[on].append(ev.gen_tps)
                if on and lm.cache is not None:
                    snap = lm.cache.snapshot()
                    used = (snap.total.prefetched, snap.total.prefetch_hits, snap.tokens)
        a, b = sorted(tps[False])[repeats // 2], sorted(tps[True])[repeats // 2]
        print(
            f"| {gbps:g} GB/s | {a:.1f} | {b:.1f} | {b / a:.2f} | {used[0] / used[2]:.1f} / {used[1] / used[2]:.1f} |"
        )
    lm.close()


def per_layer_table(recall: dict[int, list[float]]) -> None:
    print("\n| layer | " + " | ".join(str(layer) for layer in sorted(recall)) + " |")
    print("|---|" + "---|" * len(recall))
    print("| recall | " + " | ".join(f"{100 * sum(v) / len(v):.0f}%" for _, v in sorted(recall.items())) + " |")


if __name__ == "__main__":
    main()
