"""Fit a built-in demo's recipe: a small dense model -> a Mixture of Experts, with no external data.

    python scripts/moefy_demo.py texts --demo smollm2 --out texts.json   # the dense model writes its own text
    python scripts/moefy_demo.py fit texts.json --demo smollm2           # cluster, pick experts -> assets/
    python scripts/moefy_demo.py check texts.json --demo smollm2         # build the GGUF, measure it in the engine

1. texts: the dense model writes its own text. A chat model (SmolLM2) answers the self-written
   prompts of assets/demo_prompts.json, with sampling, and each text is the whole chat
   turn (template, prompt, reply, end of turn); the `held_out_text` prompts' replies are held out.
   A base model (Gemma) continues a few seed prompts; its last texts are held out.
2. fit, for each layer: run the texts through the dense model and record the FFN input h (after
   its norm) and each neuron's contribution c = (|act(gate h) * up h| * ||down column||)^2.
   - Token clusters: k-means (cosine, k-means++ start) of the FFN inputs into E clusters. The
     router is the clusters' unit centroids: a token goes to its nearest centroid (top-1), so the
     router is exactly the clustering, with no fitting error of its own.
   - Shared expert: the S neurons with the largest mean contribution over the clusters.
   - Routed expert e: the R other neurons that cluster e's tokens use most. Experts overlap
     (a neuron can serve several clusters) but never include a shared neuron, so a token's FFN
     counts each neuron once, with its dense gating: the model only drops neurons.
   - R: the smallest width in the sweep whose held-out perplexity is within MARGIN of the dense
     model's (the margin covers the requantized `down` and the few held-out texts).
3. Writes the recipe (shared and routed neuron indices, router, k = 1) and prints the quality table
   (perplexity, greedy agreement over 256 tokens) and the routing statistics.
4. check: builds the demo GGUF as users get it and measures, in the engine, held-out perplexity
   against the dense file and, for a chat model, how many held-out chat prompts end on an
   end-of-turn token at temperature 0.

Why overlapping top-1 experts and not a partition of the neurons with top-k routing: measured in
docs/design.md ("The demo model"). Partitions hold quality only with nearly every expert selected,
which is uniform routing; token clusters route skewed and reuse experts, as real MoE models do.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from moechat.demo.build import DEFAULT_DEMO, DEMOS, DemoSpec, recipe_path
from moechat.engine.events import GREEDY, DoneEvent, SamplingParams, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import LoadedModel
from moechat.engine.nn.layers import load_weight
from moechat.tuner.routing_stats import lru_hit_rate, reuse_rate, top_share
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent

SEEDS = [
    "The history of the old harbour town begins",
    "When the first snow fell that winter, the children",
    "A good recipe for bread needs only four things:",
    "The scientist looked at the results again and realised",
    "In the middle of the forest there was a small house where",
    "The train was late, so she decided to walk",
    "Most people do not know that the moon",
    "He opened the letter slowly. It said that",
    "The rules of the game are simple. Each player",
    "After the war, the city rebuilt its library",
    "The best way to learn a new language is",
    "On the first day of school, the teacher asked",
]


def prompts() -> dict[str, list[str]]:
    return json.loads((ROOT / "assets" / "demo_prompts.json").read_text())


def source_path(spec: DemoSpec) -> Path:
    from moechat.app.paths import app_paths

    return spec.source(app_paths().cache / "sources")


def load_dense(spec: DemoSpec) -> LoadedModel:
    from moechat.engine.loader import load_model

    return load_model(source_path(spec), n_ctx=1024)


def make_texts(spec: DemoSpec, out: Path, n_tokens: int, seed: int) -> None:
    """JSON {"fit": [...], "held_out": [...]} of token lists the dense model wrote."""
    lm = load_dense(spec)
    t = time.time()

    def write(ids: list[int], chat: bool, i: int) -> list[int]:
        params = SamplingParams(temperature=0.7 if chat else 0.8, top_p=0.95, top_k=64, min_p=0.0,
                                repeat_penalty=1.1, seed=seed + i)  # fmt: skip
        events = list(generate(lm.model, lm.tokenizer, ids, lm.new_cache(), max_tokens=n_tokens, params=params,
                               ignore_eos=not chat))  # fmt: skip
        reply = [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]
        done = events[-1]
        if not isinstance(done, DoneEvent):
            raise RuntimeError("generation ended without its DoneEvent")
        end = lm.tokenizer.special.eot if lm.tokenizer.special.eot is not None else lm.tokenizer.special.eos
        print(f"text {i + 1}: {len(reply)} tokens ({done.stop_reason}), {time.time() - t:.0f} s", file=sys.stderr)
        return ids + reply + ([end] if done.stop_reason == "eos" and end is not None else [])

    if spec.name == "gemma":  # a base model: continuations, the last texts held out
        texts = [write(lm.tokenizer.encode(p), False, i) for i, p in enumerate(SEEDS)]
        out.write_text(json.dumps({"fit": texts[:-3], "held_out": texts[-3:]}))
        return
    p = prompts()
    fit = [write(lm.chat_prompt(q), True, i) for i, q in enumerate(p["fit"])]
    held = [write(lm.chat_prompt(q), True, 1000 + i) for i, q in enumerate(p["held_out_text"])]
    out.write_text(json.dumps({"fit": fit, "held_out": held}))


MARGIN = 1.08  # the goal is +10%; the engine check adds the requantized `down`
WIDTHS = {"gemma": (512, 576, 640, 704), "smollm2": (320, 384, 448, 480)}
SHARED = {"gemma": 1280, "smollm2": 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("texts")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--tokens", type=int, default=None, help="longest text (default: 320 base, 256 chat)")
    t.add_argument("--seed", type=int, default=1234)
    for name in ("fit", "check"):
        f = sub.add_parser(name)
        f.add_argument("texts", type=Path)
        f.add_argument("--recipe", type=Path, default=None, help="default: the demo's shipped recipe")
    for p in sub.choices.values():
        p.add_argument("--demo", choices=sorted(DEMOS), default=DEFAULT_DEMO)
    fit_p = sub.choices["fit"]
    fit_p.add_argument("--experts", type=int, default=16)
    fit_p.add_argument("--shared", type=int, default=None, help="neurons in the shared expert")
    args = ap.parse_args()
    spec = DEMOS[args.demo]
    torch.manual_seed(0)
    if args.cmd == "texts":
        make_texts(spec, args.out, args.tokens or (320 if spec.name == "gemma" else 256), args.seed)
        return
    recipe = args.recipe or ROOT / "assets" / recipe_path(spec.name).name
    if args.cmd == "fit":
        fit(spec, args.texts, args.experts, args.shared or SHARED[spec.name], recipe)
    else:
        check(spec, args.texts, recipe)


def kmeans(x: torch.Tensor, k: int, iters: int = 30) -> torch.Tensor:
    """Unit centroids [k, E] of the rows of x by cosine k-means with a k-means++ start."""
    x = F.normalize(x, dim=-1)
    c = x[torch.randint(x.shape[0], (1,))]
    for _ in range(k - 1):
        far = (1 - (x @ c.T).max(1).values).clamp(min=0) + 1e-9  # [N]
        c = torch.cat([c, x[torch.multinomial(far, 1)]])
    for _ in range(iters):
        a = (x @ c.T).argmax(1)
        c = F.normalize(torch.stack([x[a == j].mean(0) if (a == j).any() else c[j] for j in range(k)]), dim=-1)
    return c


@dataclass
class Layer:
    router: torch.Tensor  # [n_expert, E]: unit centroids
    shared: torch.Tensor  # [S]
    order: torch.Tensor  # [n_expert, F - S]: each cluster's non-shared neurons, most used first

    def routed(self, width: int) -> torch.Tensor:
        return self.order[:, :width]


@dataclass
class DenseWeights:
    gate: torch.Tensor  # [F, E]
    up: torch.Tensor  # [F, E]
    down: torch.Tensor  # [E, F]
    act: str

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        g = h @ self.gate.T  # [N, F]
        g = F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")
        return g * (h @ self.up.T)


def dense_weights(lm: LoadedModel, spec: DemoSpec) -> list[DenseWeights]:
    def w(i: int, kind: str) -> torch.Tensor:
        return load_weight(lm.gguf, f"blk.{i}.ffn_{kind}.weight")

    return [DenseWeights(w(i, "gate"), w(i, "up"), w(i, "down"), spec.act) for i in range(lm.config.n_layers)]


def fit_layer(ffn: DenseWeights, h: torch.Tensor, n_expert: int, n_shared: int) -> Layer:
    contrib = (ffn.hidden(h).abs() * ffn.down.norm(dim=0)) ** 2  # [N, F]
    router = kmeans(h, n_expert)
    cluster = (h @ router.T).argmax(1)  # [N]
    use = torch.stack([contrib[cluster == e].mean(0) if (cluster == e).any() else contrib.mean(0)
                       for e in range(n_expert)])  # [n_expert, F]  # fmt: skip
    shared = torch.topk(use.mean(0), n_shared).indices
    use[:, shared] = -1.0
    order = torch.argsort(use, dim=1, descending=True)[:, : use.shape[1] - n_shared]
    return Layer(router, torch.sort(shared).values, order)


def routed_ffn(ffn: DenseWeights, layer: Layer, width: int, picks: list[torch.Tensor] | None = None) -> object:
    """The MoE version of a dense FFN: shared neurons plus the nearest cluster's expert."""
    n_expert = layer.router.shape[0]
    mask = torch.zeros(n_expert, ffn.gate.shape[0], dtype=torch.bool)
    mask.scatter_(1, layer.routed(width), True)
    mask[:, layer.shared] = True

    def forward(h: torch.Tensor, experts: object = None) -> torch.Tensor:
        e = (h @ layer.router.T).argmax(1)  # [T]
        if picks is not None:
            picks.append(e)
        return (ffn.hidden(h) * mask[e]) @ ffn.down.T

    return forward


@contextmanager
def routed(blocks: Sequence[Any], weights: list[DenseWeights], layers: list[Layer], width: int,
           picks: list[list[torch.Tensor]] | None = None) -> Iterator[None]:  # fmt: skip
    """Every block's FFN routed (recording the experts picked, per layer), dense again afterwards."""
    dense = [b.ffn.forward for b in blocks]
    for i, (b, layer) in enumerate(zip(blocks, layers, strict=True)):
        b.ffn.forward = routed_ffn(weights[i], layer, width, picks[i] if picks is not None else None)
    try:
        yield
    finally:
        for b, fwd in zip(blocks, dense, strict=True):
            b.ffn.forward = fwd


def nll(lm: LoadedModel, ids: list[int], skip: int) -> tuple[float, int]:
    with torch.inference_mode():
        logits = lm.model(torch.tensor(ids), 0, lm.new_cache())
    lp = F.log_softmax(logits[skip:-1].double(), dim=-1)
    target = torch.tensor(ids[skip + 1 :])
    return float(-lp.gather(1, target[:, None]).sum()), len(target)


def perplexity(lm: LoadedModel, texts: list[list[int]], skip: int = 8) -> float:
    r = [nll(lm, ids, skip) for ids in texts]
    return math.exp(sum(n for n, _ in r) / sum(c for _, c in r))


def routing_stats(picks: list[torch.Tensor], n_expert: int) -> tuple[float, float, float]:
    """Share of selections by the top 20% of experts, reuse within 8 tokens, LRU hit rate with half
    the experts cached (uniform random routing: 0.2, about 0.4, 0.5)."""
    steps = [[e] for e in torch.cat(picks).tolist()]
    return top_share(steps, n_expert), reuse_rate(steps), lru_hit_rate(steps, n_expert // 2)


def record_inputs(lm: LoadedModel, texts: list[list[int]]) -> list[torch.Tensor]:
    blocks = lm.model.blocks
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(blocks))}
    hooks = [b.ffn.register_forward_hook(lambda m, inp, out, i=i: inputs[i].append(inp[0].detach()))
             for i, b in enumerate(blocks)]  # fmt: skip
    with torch.inference_mode():
        for ids in texts:
            lm.model(torch.tensor(ids), 0, lm.new_cache())
    for hook in hooks:
        hook.remove()
    return [torch.cat(inputs[i]) for i in range(len(blocks))]  # [N, E] per layer


def read_texts(path: Path) -> tuple[list[list[int]], list[list[int]]]:
    texts = json.loads(path.read_text())
    return texts["fit"], texts["held_out"]


def fit(spec: DemoSpec, texts_path: Path, n_expert: int, n_shared: int, out: Path) -> None:
    lm = load_dense(spec)
    blocks = lm.model.blocks
    weights = dense_weights(lm, spec)
    train, test = read_texts(texts_path)
    t = time.time()
    inputs = record_inputs(lm, train)
    layers = [fit_layer(w, h, n_expert, n_shared) for w, h in zip(weights, inputs, strict=True)]
    print(f"clustered {len(layers)} layers in {time.time() - t:.0f} s", file=sys.stderr)

    dense_ppl = perplexity(lm, test)
    rows = [("dense", dense_ppl, 1.0, "")]
    widths = WIDTHS[spec.name]
    chosen = widths[-1]
    n_ff = weights[0].gate.shape[0]
    for width in widths:
        picks: list[list[torch.Tensor]] = [[] for _ in blocks]
        with routed(blocks, weights, layers, width, picks):
            ppl = perplexity(lm, test)
        stats = np.mean([routing_stats(p, n_expert) for p in picks], axis=0)
        active = (n_shared + width) / n_ff
        routing = f"{stats[0]:.0%} / {stats[1]:.0%} / {stats[2]:.0%}"
        rows.append((f"MoE {n_shared} shared + 1 of {n_expert} x {width} ({active:.1%} active)", ppl,
                     ppl / dense_ppl, routing))  # fmt: skip
        print(f"width {width}: perplexity {ppl:.3f} ({ppl / dense_ppl - 1:+.1%}), routing {routing}", file=sys.stderr)
        if ppl <= MARGIN * dense_ppl:
            chosen = width
            break
    agree = greedy_agreement(lm, weights, test[0][:24], layers, chosen)
    np.savez_compressed(
        out,
        shared=torch.stack([x.shared for x in layers]).numpy().astype(np.int16),
        routed=torch.stack([x.routed(chosen) for x in layers]).numpy().astype(np.int16),
        router=torch.stack([x.router for x in layers]).numpy().astype(np.float32),
        k=np.int32(1),
    )
    print("| model | held-out perplexity | vs dense | top-20% share / reuse within 8 / LRU hit at half |")
    print("|---|---:|---:|---|")
    for name, ppl, ratio, routing in rows:
        print(f"| {name} | {ppl:.3f} | {ratio:.3f} | {routing} |")
    print(f"\nchosen width {chosen}; greedy agreement over 256 tokens: {agree}")
    print(f"recipe written to {out} ({out.stat().st_size / 1024:.0f} KiB)")


def greedy_agreement(lm: LoadedModel, weights: list[DenseWeights], prompt: list[int], layers: list[Layer],
                     width: int, n: int = 256) -> str:  # fmt: skip
    """Dense greedy continuation vs MoE: tokens equal before the first difference, and top-1 agreement
    when the MoE model reads the dense continuation (teacher forcing)."""
    model = lm.model

    def run() -> list[int]:
        ev = generate(model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=n, params=GREEDY, ignore_eos=True)
        return [e.token for e in ev if isinstance(e, TokenEvent) and e.token >= 0]

    dense = run()
    with routed(model.blocks, weights, layers, width):
        moe = run()
        same = next((i for i, (x, y) in enumerate(zip(dense, moe, strict=False)) if x != y), min(len(dense), len(moe)))
        with torch.inference_mode():
            logits = model(torch.tensor(prompt + dense), 0, lm.new_cache())
    forced = float((logits[len(prompt) - 1 : -1].argmax(-1) == torch.tensor(dense)).float().mean())
    return f"{same} identical tokens before the first difference; teacher-forced top-1 {forced:.1%}"


def end_of_turn_rate(lm: LoadedModel, questions: list[str], max_tokens: int = 256) -> tuple[float, list[str]]:
    """Share of replies at temperature 0 that end on an end-of-turn token, and the replies."""
    ended, replies = 0, []
    for q in questions:
        events = list(generate(lm.model, lm.tokenizer, lm.chat_prompt(q), lm.new_cache(), max_tokens=max_tokens,
                               params=GREEDY))  # fmt: skip
        done = events[-1]
        ended += isinstance(done, DoneEvent) and done.stop_reason == "eos"
        replies.append("".join(e.text for e in events if isinstance(e, TokenEvent)))
    return ended / len(questions), replies


def check(spec: DemoSpec, texts_path: Path, recipe: Path) -> None:
    """The shipped artefact, measured in the engine: build the demo GGUF from the recipe (Q8_0
    `down`, as users get it) and compare it with the dense source file."""
    import tempfile

    from moechat.demo.build import build_demo
    from moechat.engine.loader import load_model

    _, test = read_texts(texts_path)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.time()
        built = build_demo(source_path(spec), recipe, Path(tmp) / "demo.gguf", spec=spec)
        print(f"built in {time.time() - t:.1f} s, {built.stat().st_size / 2**20:.0f} MiB", file=sys.stderr)
        dense, moe = load_dense(spec), load_model(built, n_ctx=1024)
        dense_ppl, moe_ppl = perplexity(dense, test), perplexity(moe, test)
        print(
            f"engine, held-out perplexity: dense {dense_ppl:.3f}, demo {moe_ppl:.3f} ({moe_ppl / dense_ppl - 1:+.1%})"
        )
        if spec.name == "gemma":
            return
        questions = prompts()["held_out_chat"]
        for name, lm in (("dense", dense), ("demo", moe)):
            rate, replies = end_of_turn_rate(lm, questions)
            print(f"{name}: {rate:.0%} of {len(questions)} held-out chat replies end on an end-of-turn token")
            for q, r in zip(questions[:3], replies, strict=False):
                print(f"  {q} -> {r[:160]!r}")


if __name__ == "__main__":
    main()
