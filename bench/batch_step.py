"""A decode step of n sequences (`DecoderBase.step`, what `moechat serve --parallel` runs) against one token alone,
in-process, the model's kernels without an expert cache.

    python bench/batch_step.py [MODEL.gguf] [--sizes 1 2 4 8] [--steps 30] [--rounds 2]

Each size's sequences are short different prompts, each on its slot of one KV bank; a step is timed over
`--steps` steps after three warm ones (size 1: `generate.decode_one`, the plan one token runs). Prints ms per
step and tokens/s per size, and each size's tokens/s over size 1's, medians of the rounds (which alternate the
sizes), with the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from moechat.app.demo_model import resolve_model
from moechat.engine.generate import decode_one, one_torch_thread, prefill
from moechat.engine.loader import load_model
from moechat.engine.nn.layers import KVBank, KVCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a GGUF (default: the demo)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    lm = load_model(resolve_model(args.model), n_ctx=512)
    model = lm.model
    prompts = [lm.tokenizer.encode(f"Tell me about topic number {i}, please.") for i in range(max(args.sizes))]
    ms: dict[int, list[float]] = {n: [] for n in args.sizes}
    with torch.inference_mode(), one_torch_thread(True):
        for r in range(args.rounds):
            for n in args.sizes if r % 2 == 0 else args.sizes[::-1]:
                caches = KVBank(lm.config, 512, n).caches()
                tokens = [int(prefill(model, p, c).argmax()) for p, c in zip(prompts, caches, strict=False)]

                def step(n: int = n, caches: list[KVCache] = caches, tokens: list[int] = tokens) -> None:
                    if n == 1:
                        decode_one(model, tokens[0], caches[0])
                    else:
                        model.step(tokens, caches)

                for _ in range(3):
                    step()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                ms[n].append((time.perf_counter() - t0) / args.steps * 1e3)
    base = args.sizes[0]
    print(f"{'sequences':>9} {'ms/step':>8} {'tokens/s':>9} {'/ ' + str(base):>6}")
    one = base / statistics.median(ms[base]) * 1e3
    for n in args.sizes:
        t = statistics.median(ms[n])
        print(f"{n:>9} {t:>8.1f} {n / t * 1e3:>9.1f} {n / t * 1e3 / one:>6.2f}")
    print(f"model {lm.gguf.path.name}; load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    lm.close()


if __name__ == "__main__":
    main()
