"""The quality bar of the kernel modes: perplexity on real text and KL to the exact path, beside llama.cpp's.

    python bench/quality.py [MODEL.gguf ...] [--tokens 2048] [--modes fast,int8] [--no-peer]

Default models: the two demo sources (SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M, from the
test cache). The text: tests/testkit/data/alice_ch1_2.txt (public domain). Per model, the exact
path (dequantize, float32 matmuls) and each mode, CHUNK tokens per call (decode's kernels), and
llama.cpp on the same token ids (its CPU kernels round activations to 8 bits: its KL to our exact
path is the yardstick). A fast mode may be a default where its perplexity is within 1% of the exact
path's and its KL at most 1.5x llama.cpp's (tests/test_quality_bar.py holds the modes to the figures
this prints).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_overhead import cpu_name
from moechat.engine.loader import load_model
from testkit import quality


def peer_logits(path: Path, ids: list[int], threads: int) -> np.ndarray:
    """llama.cpp's logits at every position of ids (float32 [N, V])."""
    import llama_cpp
    from compare_llamacpp import _no_extra_buffer_types

    _no_extra_buffer_types()
    peer = llama_cpp.Llama(str(path), n_ctx=len(ids) + 8, n_batch=512, logits_all=True, n_threads=threads,
                           n_threads_batch=threads, verbose=False)  # fmt: skip
    peer.reset()
    peer.eval(ids)
    out = np.array(peer.scores[: len(ids)], dtype=np.float32)
    peer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--tokens", type=int, default=quality.TOKENS)
    ap.add_argument("--modes", default="fast,int8")
    ap.add_argument("--no-peer", action="store_true", help="without llama.cpp")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    models = args.models
    if not models:
        from conftest import TEST_CACHE
        from moechat.demo.source import gemma_gguf, smollm2_gguf

        models = [smollm2_gguf(TEST_CACHE / "sources"), gemma_gguf(TEST_CACHE / "sources")]
    modes = args.modes.split(",")
    print(f"CPU: {cpu_name()}; {args.tokens} tokens of {quality.TEXT_PATH.name}; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("\n| model | mode | perplexity | vs exact | mean KL to exact | top-1 |")
    print("|---|---|---:|---:|---:|---:|")
    for path in models:
        exact = load_model(path, n_ctx=args.tokens + 8, cpu_kernels="exact")
        ids = quality.token_ids(exact, args.tokens)
        streams = {m: quality.windows(load_model(path, n_ctx=args.tokens + 8, cpu_kernels=m), ids, quality.CHUNK)
                   for m in modes}  # fmt: skip
        if not args.no_peer:
            streams["llama.cpp"] = quality.array_windows(peer_logits(path, ids, args.threads))
        t = time.perf_counter()
        result = quality.compare(quality.windows(exact, ids, quality.WINDOW), streams, ids)
        for name, q in result.items():
            print(f"| {path.name} | {name} | {q.perplexity:.4f} | {q.perplexity_change:+.2%} | {q.kl:.3e} | "
                  f"{q.top1:.1%} |")  # fmt: skip
        print(f"| {path.name} | exact | {next(iter(result.values())).exact_perplexity:.4f} | | | |"
              f"  ({time.perf_counter() - t:.0f} s)")  # fmt: skip
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
