"""Decode and prefill t/s of moechat (CPU device, default settings) vs llama.cpp on the same GGUF.

    pip install 'moechat[peer]'     # llama-cpp-python from source; see docs/measurements.md for flags
    python bench/decode_vs_llamacpp.py [--threads 2] [--big]

Rows, each timed in alternating runs of both engines with the same thread count and the same
token ids (bench/compare_llamacpp.compare; logits agreement is reported too):
  - for each built-in demo, its dense source (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M),
    then the demo itself (with a shared expert, which llama.cpp cannot run): its t/s against
    llama.cpp's on the dense source, timed in the same run;
  - with --big: a generated model with Qwen3-30B-A3B's geometry (hidden 2048, 32/4 heads of 128,
    128 experts, top 8, expert FFN 768, the Qwen vocabulary) and 12 layers in a Q4_K_M mix (Q4_K
    gate/up/attention/embedding, Q6_K down and output), about 5 GB: it fits in no CPU cache.
The load average is printed with the table: this machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from compare_llamacpp import _speed_in_process, compare


def ours_only(path: Path, n_pos: int, n_decode: int, threads: int, repeats: int) -> tuple[float, float]:
    """moechat's prefill and decode t/s on a file llama.cpp cannot run (medians of `repeats` processes)."""
    runs = [_speed_in_process("ours", path, n_pos, n_decode, threads) for _ in range(repeats)]
    return n_pos / statistics.median(r[0] for r in runs), n_decode / statistics.median(r[1] for r in runs)


def qwen3_shaped(out: Path) -> Path:
    from testkit.ggufgen import Q, tiny_moe

    return tiny_moe(out, n_layers=12, n_embd=2048, n_head=32, n_head_kv=4, n_expert=128, n_expert_used=8,
                    n_ff_exp=768, expert_type=Q.Q4_K, down_type=Q.Q6_K, dense_type=Q.Q4_K, ends_type=Q.Q4_K,
                    output_type=Q.Q6_K, n_vocab=151_000)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--big", action="store_true", help="also the generated 5 GB Qwen3-30B-A3B-shaped model")
    args = ap.parse_args()
    from moechat.app.paths import app_paths
    from moechat.engine.demo import DEMOS, ensure_demo

    cache = app_paths().cache
    print("| model | top-1 | pp t/s ours | pp t/s llama.cpp | ratio | tg t/s ours | tg t/s llama.cpp | ratio |")
    print("|---|---|---|---|---|---|---|---|")

    def row(label: str, r: dict[str, float | str]) -> None:
        f = {k: float(v) for k, v in r.items() if k != "model"}
        print(f"| {label} | {100 * f['top1']:.1f}% | {f['pp_ours']:.1f} | {f['pp_peer']:.1f} | "
              f"{f['pp_ours'] / f['pp_peer']:.2f} | {f['tg_ours']:.2f} | {f['tg_peer']:.2f} | "
              f"{f['tg_ours'] / f['tg_peer']:.2f} |", flush=True)  # fmt: skip

    for spec in DEMOS.values():
        source, demo = spec.source(cache / "sources"), ensure_demo(cache, name=spec.name)
        dense = compare(source, args.positions, args.decode, args.threads, args.repeats)
        row(f"{source.name} (the {spec.name} demo's source, dense)", dense)
        pp, tg = ours_only(demo, args.positions, args.decode, args.threads, args.repeats)
        pp_peer, tg_peer = float(dense["pp_peer"]), float(dense["tg_peer"])
        print(f"| the {spec.name} demo vs llama.cpp on its dense source | - | {pp:.1f} | {pp_peer:.1f} | "
              f"{pp / pp_peer:.2f} | {tg:.2f} | {tg_peer:.2f} | {tg / tg_peer:.2f} |", flush=True)  # fmt: skip
    if args.big:
        with tempfile.TemporaryDirectory() as tmp:
            big = qwen3_shaped(Path(tmp) / "qwen3-30b-a3b-shaped-12l-q4km.gguf")
            label = f"Qwen3-30B-A3B geometry, 12 layers, Q4_K_M ({big.stat().st_size / 1e9:.1f} GB)"
            row(label, compare(big, args.positions, args.decode, args.threads, args.repeats))
    load = os.getloadavg()
    print(f"\n{args.threads} threads; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
