"""moechat vs llama.cpp on the same GGUF files: logits agreement and speed, side by side.

    pip install 'moechat[peer]'          # llama-cpp-python, builds llama.cpp from source (~20 min)
    python bench/compare_llamacpp.py                 # the test models of every architecture
    python bench/compare_llamacpp.py MODEL.gguf ...  # your own files
    python bench/compare_llamacpp.py --f32-copy MODEL.gguf   # and an F32 copy of each

Both engines get the same token ids (no tokenizer differences), all positions' logits are
compared (top-1 agreement, mean KL(llama.cpp || moechat)), then prefill and decode speed are
timed in alternating runs with the same thread count. Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.engine.generate import decode_one, prefill
from moechat.engine.loader import load_model, set_threads

TEXT = (
    "The lighthouse stood at the end of a long spit of sand, and for most of the year nobody went out to it "
    "except the keeper, who walked the path twice a day with a lantern and a notebook. In the winter the sea "
    "came over the path and he stayed inside for days at a time, reading the same few books, mending nets he "
    "no longer used, and writing down the weather in careful columns. "
)


def test_models(out: Path, logit_scale: float) -> list[Path]:
    """Every architecture's test model; `logit_scale` > 1 makes the random output layer as confident as an LM's."""
    from testkit.ggufgen import ARCHS, Q, tiny_moe

    paths = []
    for arch in ARCHS:
        types = [Q.F32, Q.MXFP4] if arch == "gpt-oss" else [Q.F32, Q.Q8_0, Q.Q4_K]
        for qtype in types:
            name = f"{arch}-{qtype.name}{'-peaked' if logit_scale != 1 else ''}.gguf"
            paths.append(tiny_moe(out / name, arch=arch, expert_type=qtype, n_vocab=4096, logit_scale=logit_scale))
    return paths


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _no_extra_buffer_types() -> None:
    """Make llama.cpp skip its extra CPU buffer types (AMX, repacked layouts).

    Some virtual machines advertise AMX but trap on its instructions: llama.cpp then dies with an
    illegal instruction on the types it would put in AMX buffers. Plain CPU buffers work everywhere.
    """
    import llama_cpp

    default = llama_cpp.llama_model_default_params

    def params() -> object:
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    llama_cpp.llama.llama_cpp.llama_model_default_params = params


def compare(
    path: Path,
    n_pos: int,
    n_decode: int,
    threads: int,
    repeats: int,
    cpu_dequant_mib: float = 0.0,
    cpu_kernels: str = "fast",
) -> dict[str, float | str]:
    import llama_cpp

    set_threads(threads)
    ours = load_model(path, n_ctx=n_pos + n_decode + 8, cpu_dequant_mib=cpu_dequant_mib, cpu_kernels=cpu_kernels)
    ids = ours.tokenizer.encode(TEXT * 20)[:n_pos]  # BOS as the model asks, as in real use
    peer = llama_cpp.Llama(str(path), n_ctx=n_pos + n_decode + 8, n_batch=512, logits_all=True,
                           n_threads=threads, n_threads_batch=threads, verbose=False)  # fmt: skip

    # Logits of every position.
    peer.reset()
    peer.eval(ids)
    ref = np.array(peer.scores[:n_pos], dtype=np.float64)
    cache = ours.new_cache()
    with torch.inference_mode():
        got = ours.model(torch.tensor(ids), 0, cache).double().numpy()
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())

    # Speed, alternating engines.
    times: dict[str, list[float]] = {"ours_pp": [], "peer_pp": [], "ours_tg": [], "peer_tg": []}
    for _ in range(repeats):
        peer.reset()
        t = time.perf_counter()
        peer.eval(ids)
        times["peer_pp"].append(time.perf_counter() - t)
        tok = int(np.argmax(peer.scores[n_pos - 1]))
        t = time.perf_counter()
        for _ in range(n_decode):
            peer.eval([tok])
            tok = int(np.argmax(peer.scores[peer.n_tokens - 1]))
        times["peer_tg"].append(time.perf_counter() - t)

        cache = ours.new_cache()
        t = time.perf_counter()
        logits = prefill(ours.model, ids, cache)
        times["ours_pp"].append(time.perf_counter() - t)
        tok = int(logits.argmax())
        t = time.perf_counter()
        for _ in range(n_decode):
            tok = int(decode_one(ours.model, tok, cache).argmax())
        times["ours_tg"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    peer.close()
    ours.close()
    return {
        "model": path.name,
        "top1": top1,
        "kl": kl,
        "pp_ours": n_pos / med["ours_pp"],
        "pp_peer": n_pos / med["peer_pp"],
        "tg_ours": n_decode / med["ours_tg"],
        "tg_peer": n_decode / med["peer_tg"],
    }


def f32_copy(path: Path, out_dir: Path) -> Path:
    """The same model with every tensor dequantized to F32.

    On quantized weights llama.cpp's CPU kernels round the activations to 8 bits (Q8_0 or Q8_K
    blocks) before the dot products; moechat computes with exact fp32 activations. On an F32
    copy both do fp32 arithmetic, so what is left between them is the model code itself.
    """
    from gguf import GGUFWriter
    from moechat.engine.gguf_file import GGUFFile, copy_metadata
    from moechat.engine.quants import dequantize

    out = out_dir / f"{path.stem}-f32.gguf"
    with GGUFFile(path) as src:
        w = GGUFWriter(str(out), src.architecture)
        copy_metadata(src, w, src.architecture, skip=("general.file_type",))  # every tensor is F32 now
        for name, t in src.tensors.items():
            w.add_tensor(name, dequantize(src.tensor_data(name), t.qtype).numpy().astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path, help="GGUF files (default: the test models)")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--logit-scale", type=float, default=1.0, help="test models: scale of the output layer")
    ap.add_argument(
        "--no-extra-bufts",
        action="store_true",
        help="llama.cpp without AMX/repacked buffers (for CPUs that advertise AMX but trap on it)",
    )
    ap.add_argument(
        "--f32-copy",
        action="store_true",
        help="also compare an F32 copy of each file: llama.cpp then does no quantized-activation arithmetic",
    )
    args = ap.parse_args()
    if args.no_extra_bufts:
        _no_extra_buffer_types()
    with tempfile.TemporaryDirectory() as tmp:
        models = args.models or test_models(Path(tmp), args.logit_scale)
        if args.f32_copy:
            models = [x for m in models for x in (m, f32_copy(m, Path(tmp)))]
        rows = [compare(m, args.positions, args.decode, args.threads, args.repeats) for m in models]
    head = ["model", "top-1", "mean KL", "pp t/s ours", "pp t/s llama.cpp", "ratio", "tg t/s ours",
            "tg t/s llama.cpp", "ratio"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        f = {k: float(v) for k, v in r.items() if k != "model"}
        print(
            f"| {r['model']} | {100 * f['top1']:.1f}% | {f['kl']:.2e} | {f['pp_ours']:.0f} | {f['pp_peer']:.0f} | "
            f"{f['pp_ours'] / f['pp_peer']:.2f} | {f['tg_ours']:.1f} | {f['tg_peer']:.1f} | "
            f"{f['tg_ours'] / f['tg_peer']:.2f} |"
        )


if __name__ == "__main__":
    main()
