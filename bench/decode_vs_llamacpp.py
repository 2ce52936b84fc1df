"""Decode and prefill t/s of moechat (CPU device, default settings) vs llama.cpp on the same GGUF.

    pip install 'moechat[peer]'     # llama-cpp-python from source; docs/measurements.md says which flags
    python bench/decode_vs_llamacpp.py [--threads 2] [--big]

Rows, each timed in alternating runs of both engines with the same thread count and the same
token ids (bench/compare_llamacpp.compare; logits agreement with moechat's defaults is reported
too). moechat runs twice: with its defaults (int16 activations) and with --cpu-kernels int8
(llama.cpp's approximation of the activations):
  - for each built-in demo, its dense source (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M),
    then the demo itself (with a shared expert, which llama.cpp cannot run): its t/s against
    llama.cpp's on the dense source, timed in the same run;
  - with --big: two generated models that fit in no CPU cache. Qwen3-30B-A3B's layer geometry
    (hidden 2048, 128 experts, top 8, expert FFN 768; 32/4 heads of 64, not the real 128, as the
    generator derives them from the hidden size; its 32,771-token Qwen vocabulary, not the real
    151,936) in 12 layers of a Q4_K_M mix (Q4_K gate/up/attention/embedding, Q6_K down and
    output), 4.9 GB; and gpt-oss-20b's (`gpt_oss_shaped`), 8 layers of MXFP4 experts, 3.8 GB.
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


def ours_only(path: Path, n_pos: int, n_decode: int, threads: int, repeats: int, engine: str) -> tuple[float, float]:
    """moechat's prefill and decode t/s on a file llama.cpp cannot run (medians of `repeats` processes)."""
    runs = [_speed_in_process(engine, path, n_pos, n_decode, threads) for _ in range(repeats)]
    return n_pos / statistics.median(r[0] for r in runs), n_decode / statistics.median(r[1] for r in runs)


def qwen3_shaped(out: Path) -> Path:
    from testkit.ggufgen import Q, tiny_moe

    return tiny_moe(out, n_layers=12, n_embd=2048, n_head=32, n_head_kv=4, n_expert=128, n_expert_used=8,
                    n_ff_exp=768, expert_type=Q.Q4_K, down_type=Q.Q6_K, dense_type=Q.Q4_K, ends_type=Q.Q4_K,
                    output_type=Q.Q6_K, n_vocab=151_000)  # fmt: skip


def gpt_oss_shaped(out: Path) -> Path:
    """gpt-oss-20b's layer geometry (hidden 2880, 32 experts of 2880, top-4, MXFP4 experts, a 128-token
    window every other layer, 201k vocabulary) in 8 of its 24 layers. Heads of 64 as the real model's,
    45 of them (its 64 would not make 2880 here), 9 KV heads."""
    from testkit.ggufgen import Q, tiny_moe

    return tiny_moe(out, arch="gpt-oss", n_layers=8, n_embd=2880, n_head=45, n_head_kv=9, n_expert=32,
                    n_expert_used=4, n_ff_exp=2880, expert_type=Q.MXFP4, dense_type=Q.Q8_0, ends_type=Q.Q8_0,
                    n_vocab=201_088, extra={"gpt-oss.attention.sliding_window": 128})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--big", action="store_true", help="also the two generated shaped models")
    args = ap.parse_args()
    from moechat.app.paths import app_paths
    from moechat.demo.build import DEMOS, ensure_demo

    cache = app_paths().cache
    print("| model | top-1 | pp t/s ours | int8 | llama.cpp | ratio | int8 | tg t/s ours | int8 | llama.cpp | ratio "
          "| int8 |\n|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip

    def row(label: str, top1: str, f: dict[str, float]) -> None:
        cells = []
        for kind, digits in (("pp", 1), ("tg", 2)):
            ours, int8, peer = f[f"{kind}_ours"], f[f"{kind}_int8"], f[f"{kind}_peer"]
            cells += [f"{ours:.{digits}f}", f"{int8:.{digits}f}", f"{peer:.{digits}f}", f"{ours / peer:.2f}",
                      f"{int8 / peer:.2f}"]  # fmt: skip
        print(f"| {label} | {top1} | " + " | ".join(cells) + " |", flush=True)

    def measured(r: dict[str, float | str]) -> dict[str, float]:
        return {k: float(v) for k, v in r.items() if k != "model"}

    for spec in DEMOS.values():
        source, demo = spec.source(cache / "sources"), ensure_demo(cache, name=spec.name)
        dense = measured(compare(source, args.positions, args.decode, args.threads, args.repeats))
        row(f"{source.name} (the {spec.name} demo's source, dense)", f"{100 * dense['top1']:.1f}%", dense)
        ours = {}
        for engine, key in (("ours", "ours"), ("int8", "int8")):
            ours[f"pp_{key}"], ours[f"tg_{key}"] = ours_only(demo, args.positions, args.decode, args.threads,
                                                             args.repeats, engine)  # fmt: skip
        row(f"the {spec.name} demo vs llama.cpp on its dense source", "-",
            ours | {"pp_peer": dense["pp_peer"], "tg_peer": dense["tg_peer"]})  # fmt: skip
    if args.big:
        with tempfile.TemporaryDirectory() as tmp:
            for make, name, what in (
                (qwen3_shaped, "qwen3-30b-a3b-shaped-12l-q4km.gguf", "Qwen3-30B-A3B geometry, 12 layers, Q4_K_M"),
                (gpt_oss_shaped, "gpt-oss-20b-shaped-8l-mxfp4.gguf", "gpt-oss-20b geometry, 8 layers, MXFP4"),
            ):
                big = make(Path(tmp) / name)
                r = measured(compare(big, args.positions, args.decode, args.threads, args.repeats))
                row(f"{what} ({big.stat().st_size / 1e9:.1f} GB)", f"{100 * r['top1']:.1f}%", r)
                big.unlink()
    load = os.getloadavg()
    print(f"\n{args.threads} threads; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
