"""Fit the built-in demo's recipe: Gemma 3 270M (dense) -> a Mixture of Experts, with no external data.

    python scripts/moefy_demo.py texts --out texts.json     # the dense model writes its own text
    python scripts/moefy_demo.py fit texts.json             # cluster, fit routers, pick k -> assets/

1. texts: the dense model continues a few seed prompts by sampling; the first part of the texts is
   for fitting, the rest is held out.
2. fit, for each layer: run the texts through the dense model and record the FFN input h (after
   its norm) and the neuron activations a = gelu(gate h) * up h.
   - Experts: the 2048 neurons are clustered into E equal groups by co-activation (balanced
     k-means on the normalised |activation| profile of each neuron over the tokens).
   - Router: least squares from h to the norm of each expert's output, ||down[:, e] a[e]||.
   - Routing keeps the dense gating exact and only selects: the top-k experts by predicted norm
     are summed with weight 1, so with k = E the model is exactly the dense one.
   - k: the smallest k whose held-out perplexity is within 15% of the dense model's.
3. Writes assets/demo_recipe.npz (neuron permutation per layer, routers, E, k) and prints the
   quality table (perplexity, greedy agreement over 256 tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from moechat.engine.generate import GREEDY, SamplingParams, TokenEvent, generate
from moechat.engine.loader import LoadedModel
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


def load_dense() -> LoadedModel:
    from moechat.app.paths import app_paths
    from moechat.engine.demo_source import source_gguf
    from moechat.engine.loader import load_model

    return load_model(source_gguf(app_paths().cache / "sources"), n_ctx=1024)


def make_texts(out: Path, n_tokens: int, seed: int) -> None:
    lm = load_dense()
    texts = []
    t = time.time()
    for i, prompt in enumerate(SEEDS):
        ids = lm.tokenizer.encode(prompt)
        params = SamplingParams(temperature=0.8, top_p=0.95, top_k=64, min_p=0.0, repeat_penalty=1.1, seed=seed + i)
        events = generate(lm.model, lm.tokenizer, ids, lm.new_cache(), max_tokens=n_tokens, params=params,
                          ignore_eos=True)  # fmt: skip
        texts.append(ids + [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0])
        print(f"text {i + 1}/{len(SEEDS)}: {len(texts[-1])} tokens, {time.time() - t:.0f} s", file=sys.stderr)
    out.write_text(json.dumps(texts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("texts")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--tokens", type=int, default=320)
    t.add_argument("--seed", type=int, default=1234)
    f = sub.add_parser("fit")
    f.add_argument("texts", type=Path)
    f.add_argument("--experts", type=int, default=16)
    f.add_argument("--held-out", type=int, default=3, help="texts kept for evaluation")
    f.add_argument("--out", type=Path, default=ROOT / "assets" / "demo_recipe.npz")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.cmd == "texts":
        make_texts(args.out, args.tokens, args.seed)
    else:
        fit(args.texts, args.experts, args.held_out, args.out)


def balanced_kmeans(feat: torch.Tensor, k: int, iters: int = 25) -> torch.Tensor:
    """Cluster the rows of `feat` (unit vectors) into k groups of exactly n/k rows; cosine similarity."""
    n = feat.shape[0]
    cap = n // k
    centers = feat[torch.randperm(n)[:k]].clone()
    assign = torch.zeros(n, dtype=torch.long)
    for _ in range(iters):
        sim = feat @ centers.T  # [n, k]
        order = torch.argsort(sim.flatten(), descending=True).tolist()
        assign.fill_(-1)
        count = [0] * k
        done = 0
        for flat in order:  # greedy: the most similar (row, cluster) pairs first, clusters capped
            row, c = divmod(flat, k)
            if assign[row] >= 0 or count[c] >= cap:
                continue
            assign[row] = c
            count[c] += 1
            done += 1
            if done == n:
                break
        centers = F.normalize(torch.stack([feat[assign == c].mean(0) for c in range(k)]), dim=-1)
    return assign


def routed_ffn(ffn: object, perm: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, k: int) -> object:
    """The MoE version of a dense Gemma FFN: top-k experts by the router, summed with weight 1."""
    gate, up, down = ffn.gate, ffn.up, ffn.down  # type: ignore[attr-defined]
    n_expert = router.shape[0]
    expert_of = torch.empty(perm.numel(), dtype=torch.long)
    expert_of[perm] = torch.arange(perm.numel()) // (perm.numel() // n_expert)

    def forward(h: torch.Tensor, experts: object = None) -> torch.Tensor:
        top = torch.topk(h @ router.T + bias, k, dim=-1).indices  # [T, k]
        keep = torch.zeros(h.shape[0], n_expert, dtype=torch.bool).scatter_(1, top, True)  # [T, E]
        a = F.gelu(h @ gate.T, approximate="tanh") * (h @ up.T)  # [T, F]
        return (a * keep[:, expert_of]) @ down.T

    return forward


def nll(lm: LoadedModel, ids: list[int], skip: int = 8) -> tuple[float, int]:
    with torch.inference_mode():
        logits = lm.model(torch.tensor(ids), 0, lm.new_cache())
    lp = F.log_softmax(logits[skip:-1].double(), dim=-1)
    target = torch.tensor(ids[skip + 1 :])
    return float(-lp.gather(1, target[:, None]).sum()), len(target)


def fit(texts_path: Path, n_expert: int, held_out: int, out: Path) -> None:
    lm = load_dense()
    model = lm.model
    texts = json.loads(texts_path.read_text())
    train, test = texts[:-held_out], texts[-held_out:]
    n_layers = len(model.blocks)
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(n_layers)}
    hooks = [b.ffn.register_forward_hook(lambda m, inp, out, i=i: inputs[i].append(inp[0].detach()))
             for i, b in enumerate(model.blocks)]  # fmt: skip
    with torch.inference_mode():
        for ids in train:
            model(torch.tensor(ids), 0, lm.new_cache())
    for h in hooks:
        h.remove()

    perms, routers, biases = [], [], []
    t = time.time()
    for i, block in enumerate(model.blocks):
        ffn = block.ffn
        h = torch.cat(inputs[i])  # [N, E]
        a = F.gelu(h @ ffn.gate.T, approximate="tanh") * (h @ ffn.up.T)  # [N, F]
        feat = F.normalize(a.abs().T, dim=-1)  # [F, N]: each neuron's activation profile
        assign = balanced_kmeans(feat, n_expert)
        perm = torch.argsort(assign, stable=True)  # neurons grouped by expert
        width = perm.numel() // n_expert
        norms = torch.stack(
            [(a[:, perm[e * width : (e + 1) * width]] @ ffn.down[:, perm[e * width : (e + 1) * width]].T).norm(dim=-1)
             for e in range(n_expert)], dim=1,
        )  # [N, E]  # fmt: skip
        x = torch.cat([h, torch.ones(h.shape[0], 1)], dim=1).double()
        reg = 1e-3 * torch.eye(x.shape[1], dtype=torch.float64)
        w = torch.linalg.solve(x.T @ x + reg, x.T @ norms.double()).float()  # [E+1, n_expert]
        perms.append(perm)
        routers.append(w[:-1].T.contiguous())
        biases.append(w[-1].contiguous())
        print(f"layer {i}: clustered and fitted ({time.time() - t:.0f} s)", file=sys.stderr)

    dense_forwards = [b.ffn.forward for b in model.blocks]
    dense = [nll(lm, ids) for ids in test]
    dense_ppl = math.exp(sum(n for n, _ in dense) / sum(c for _, c in dense))
    rows = [("dense", dense_ppl, 1.0)]
    chosen = n_expert
    for k in range(1, n_expert + 1):
        for b, perm, r, bias in zip(model.blocks, perms, routers, biases, strict=True):
            b.ffn.forward = routed_ffn(b.ffn, perm, r, bias, k)
        moe = [nll(lm, ids) for ids in test]
        ppl = math.exp(sum(n for n, _ in moe) / sum(c for _, c in moe))
        rows.append((f"MoE k={k}/{n_expert}", ppl, ppl / dense_ppl))
        print(f"k={k}: perplexity {ppl:.2f} ({ppl / dense_ppl - 1:+.1%} vs dense {dense_ppl:.2f})", file=sys.stderr)
        if ppl <= 1.15 * dense_ppl:
            chosen = k
            break
    agree = greedy_agreement(lm, test[0][:16], dense_forwards, perms, routers, biases, chosen)
    np.savez_compressed(
        out,
        perm=torch.stack(perms).numpy().astype(np.int16),
        router=torch.stack(routers).numpy().astype(np.float32),
        bias=torch.stack(biases).numpy().astype(np.float32),
        n_expert=np.int32(n_expert),
        k=np.int32(chosen),
    )
    print("| model | held-out perplexity | vs dense |")
    print("|---|---:|---:|")
    for name, ppl, ratio in rows:
        print(f"| {name} | {ppl:.2f} | {ratio:.3f} |")
    print(f"\nchosen k = {chosen} of {n_expert}; greedy agreement over 256 tokens: {agree}")
    print(f"recipe written to {out} ({out.stat().st_size / 1024:.0f} KiB)")


def greedy_agreement(
    lm: LoadedModel, prompt: list[int], dense_forwards: list[object], perms: list[torch.Tensor],
    routers: list[torch.Tensor], biases: list[torch.Tensor], k: int, n: int = 256,
) -> str:  # fmt: skip
    """Dense greedy continuation vs MoE: tokens equal before the first difference, and top-1 agreement
    when the MoE model reads the dense continuation (teacher forcing)."""
    model = lm.model
    blocks = model.blocks
    for b, fwd in zip(blocks, dense_forwards, strict=True):
        b.ffn.forward = fwd

    def run() -> list[int]:
        ev = generate(model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=n, params=GREEDY, ignore_eos=True)
        return [e.token for e in ev if isinstance(e, TokenEvent) and e.token >= 0]

    dense = run()
    for b, perm, r, bias in zip(blocks, perms, routers, biases, strict=True):
        b.ffn.forward = routed_ffn(b.ffn, perm, r, bias, k)
    moe = run()
    same = next((i for i, (x, y) in enumerate(zip(dense, moe, strict=False)) if x != y), min(len(dense), len(moe)))
    with torch.inference_mode():
        logits = model(torch.tensor(prompt + dense), 0, lm.new_cache())
    forced = float((logits[len(prompt) - 1 : -1].argmax(-1) == torch.tensor(dense)).float().mean())
    return f"{same} identical tokens before the first difference; teacher-forced top-1 {forced:.1%}"


if __name__ == "__main__":
    main()
