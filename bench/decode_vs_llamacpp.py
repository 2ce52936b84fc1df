"""Decode and prefill t/s of moechat (CPU device) vs llama.cpp on the same GGUF, same threads, alternating.

    python bench/decode_vs_llamacpp.py [--threads 2] [--big] [--no-extra-bufts]

Models: the dense Gemma 3 270M file the demo is built from (llama.cpp cannot run our gemma3moe
architecture), a generated MoE with Q8_0 experts (with and without --cpu-dequant-mib), and with
--big generated models with Qwen3-30B-A3B's expert shapes (2048 hidden, 768 expert FFN, 128 experts, top-8):
6 layers in Q4_K and 4 in Q8_0, 2.2 and 2.6 GB, so they do not fit in the CPU caches. Each runs on
the exact path and with --cpu-kernels int4. Uses compare_llamacpp.compare
(same token ids for both engines; logits agreement is reported too).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from compare_llamacpp import _no_extra_buffer_types, compare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--big", action="store_true", help="also the generated ~2 GB Qwen3-shaped model")
    ap.add_argument("--only-big", action="store_true", help="only the generated Qwen3-shaped model")
    ap.add_argument("--no-extra-bufts", action="store_true", help="llama.cpp without AMX/repacked buffers")
    args = ap.parse_args()
    if args.no_extra_bufts:
        _no_extra_buffer_types()
    from moechat.app.paths import app_paths
    from moechat.engine.demo_source import source_gguf

    # llama.cpp cannot run the demo's own architecture (gemma3moe is ours), so the demo's side is
    # the dense Gemma 3 270M file it is built from, which both engines run.
    gemma = source_gguf(app_paths().cache)
    dense = "Gemma 3 270M (the demo's source, dense)"
    runs: list[tuple[str, Path, float, str]] = [(dense, gemma, 0.0, "exact"), (dense + ", int4", gemma, 0.0, "int4")]
    with tempfile.TemporaryDirectory() as tmp:
        from testkit.ggufgen import Q, tiny_moe

        small = tiny_moe(Path(tmp) / "small-q8.gguf", n_layers=4, n_embd=512, n_expert=32, n_expert_used=4,
                         n_ff_exp=512, expert_type=Q.Q8_0, n_vocab=4096)  # fmt: skip
        runs += [
            ("generated MoE, Q8_0, exact", small, 0.0, "exact"),
            ("generated MoE, Q8_0, --cpu-dequant-mib 512", small, 512.0, "exact"),
            ("generated MoE, Q8_0, --cpu-kernels int4", small, 0.0, "int4"),
        ]
        if args.big:
            big = tiny_moe(Path(tmp) / "qwen3-shapes-q4k.gguf", n_layers=6, n_embd=2048, n_head=32, n_head_kv=4,
                           n_expert=128, n_expert_used=8, n_ff_exp=768, expert_type=Q.Q4_K, n_vocab=4096)  # fmt: skip
            label = f"Qwen3-30B-A3B shapes, 6 layers, Q4_K ({big.stat().st_size / 2**30:.1f} GiB)"
            runs += [(label, big, 0.0, "exact"), (label + ", --cpu-kernels int4", big, 0.0, "int4")]
            big8 = tiny_moe(Path(tmp) / "qwen3-shapes-q8.gguf", n_layers=4, n_embd=2048, n_head=32, n_head_kv=4,
                            n_expert=128, n_expert_used=8, n_ff_exp=768, expert_type=Q.Q8_0, n_vocab=4096)  # fmt: skip
            label = f"Qwen3-30B-A3B shapes, 4 layers, Q8_0 ({big8.stat().st_size / 2**30:.1f} GiB)"
            runs += [(label, big8, 0.0, "exact"), (label + ", --cpu-kernels int4", big8, 0.0, "int4")]
        print("| model | top-1 | pp t/s ours | pp t/s llama.cpp | ratio | tg t/s ours | tg t/s llama.cpp | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for label, path, dq, kernels in runs:
            if args.only_big and "Qwen3" not in label:
                continue
            r = compare(path, args.positions, args.decode, args.threads, args.repeats, cpu_dequant_mib=dq,
                        cpu_kernels=kernels)  # fmt: skip
            f = {k: float(v) for k, v in r.items() if k != "model"}
            print(f"| {label} | {100 * f['top1']:.1f}% | {f['pp_ours']:.1f} | {f['pp_peer']:.1f} | "
                  f"{f['pp_ours'] / f['pp_peer']:.2f} | {f['tg_ours']:.2f} | {f['tg_peer']:.2f} | "
                  f"{f['tg_ours'] / f['tg_peer']:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
