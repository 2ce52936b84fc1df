"""moechat vs llama.cpp on the same GGUF files: logits agreement and speed, side by side.

    pip install 'moechat[peer]'          # llama-cpp-python, builds llama.cpp from source (~20 min)
    python bench/compare_llamacpp.py                 # the test models of every architecture
    python bench/compare_llamacpp.py MODEL.gguf ...  # your own files
    python bench/compare_llamacpp.py --f32-copy MODEL.gguf   # and an F32 copy of each
    python bench/compare_llamacpp.py --arch qwen35moe --agreement-only --f32-copy   # one family, no timing

llama.cpp's AVX-512 build flags must match the CPU: where it has AVX512-VNNI but not AVX-VNNI (a
Zen 4 EPYC), `-DGGML_AVX_VNNI=ON` made llama.cpp die with SIGILL on an MXFP4 file; build it OFF there
(`grep -o 'avx_vnni' /proc/cpuinfo` prints nothing on such a CPU).

Both engines get the same token ids (no tokenizer differences), all positions' logits are
compared (top-1 agreement, mean KL(llama.cpp || moechat)), then prefill and decode speed are
timed in alternating runs with the same thread count. Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
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


def test_models(out: Path, logit_scale: float, archs: list[str] | None = None) -> list[Path]:
    """Every architecture's test model; `logit_scale` > 1 makes the random output layer as confident as an LM's."""
    from testkit.ggufgen import ARCHS, Q, tiny_moe

    paths = []
    for arch in archs or ARCHS:
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


def _ids(path: Path, n_pos: int) -> list[int]:
    from moechat.engine.gguf.reader import GGUFFile
    from moechat.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(GGUFFile(path).metadata, str(path))
    return tok.encode(TEXT * 20)[:n_pos]  # BOS as the model asks, as in real use


def speed(engine: str, path: Path, n_pos: int, n_decode: int, threads: int) -> tuple[float, float]:
    """Prefill and decode seconds of one engine, after a warm-up pass (run in a process of its own):
    "peer" (llama.cpp), "ours" (moechat's defaults) or "int8" (moechat with --cpu-kernels int8)."""
    ids = _ids(path, n_pos)
    if engine == "peer":
        import llama_cpp

        # n_batch sizes llama-cpp-python's logits rows (it indexes them by position); n_ubatch stays 512
        n_ctx = n_pos + n_decode + 8
        peer = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=max(512, n_ctx), n_ubatch=512, n_threads=threads,
                               n_threads_batch=threads, verbose=False)  # fmt: skip
        out = []
        for _ in range(2):  # the first pass warms up
            peer.reset()
            t = time.perf_counter()
            peer.eval(ids)
            pp = time.perf_counter() - t
            tok = int(np.argmax(peer.scores[n_pos - 1]))
            t = time.perf_counter()
            for _ in range(n_decode):
                peer.eval([tok])
                tok = int(np.argmax(peer.scores[peer.n_tokens - 1]))
            out = [pp, time.perf_counter() - t]
        peer.close()
        return out[0], out[1]
    set_threads(threads)
    ours = load_model(path, n_ctx=n_pos + n_decode + 8, cpu_kernels="int8" if engine == "int8" else "fast")
    for _ in range(2):
        cache = ours.new_cache()
        t = time.perf_counter()
        logits = prefill(ours.model, ids, cache)
        pp = time.perf_counter() - t
        tok = int(logits.argmax())
        t = time.perf_counter()
        for _ in range(n_decode):  # the greedy pick as the sampler makes it (numpy's argmax, as llama.cpp's side)
            tok = int(decode_one(ours.model, tok, cache).numpy().argmax())
        tg = time.perf_counter() - t
    ours.close()
    return pp, tg


def _in_process(call: str) -> list[float]:
    """`call` (a function of this module) in a fresh process: the numbers it prints.

    Every measurement runs alone in its process: llama.cpp's threads, left spinning in a process
    that had run it, slowed moechat's kernels 1.3x to 3x (in the same process or its parent).
    """
    paths = [str(Path(__file__).parent), str(Path(__file__).parent.parent / "tests")]
    code = f"import sys; sys.path[:0] = {paths!r}\nfrom pathlib import Path\nimport compare_llamacpp as c\n"
    code += f"print(*c.{call})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [float(v) for v in r.stdout.split()[-2:]]


def _speed_in_process(engine: str, path: Path, n_pos: int, n_decode: int, threads: int) -> tuple[float, float]:
    pp, tg = _in_process(f"speed({engine!r}, Path({str(path)!r}), {n_pos}, {n_decode}, {threads})")
    return pp, tg


def compare(path: Path, n_pos: int, n_decode: int, threads: int, repeats: int) -> dict[str, float | str]:
    """Logits agreement over every position, then speed (with `repeats` > 0): each engine in its
    own process, alternating, the median of `repeats` runs each."""
    top1, kl = _in_process(f"agreement(Path({str(path)!r}), {n_pos}, {threads})")
    if repeats == 0:
        return {"model": path.name, "top1": top1, "kl": kl}
    engines = ("peer", "ours", "int8")
    times: dict[str, list[float]] = {f"{e}_{kind}": [] for e in engines for kind in ("pp", "tg")}
    for _ in range(repeats):
        for engine in engines:
            pp, tg = _speed_in_process(engine, path, n_pos, n_decode, threads)
            times[f"{engine}_pp"].append(pp)
            times[f"{engine}_tg"].append(tg)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": path.name,
        "top1": top1,
        "kl": kl,
        "pp_ours": n_pos / med["ours_pp"],
        "pp_peer": n_pos / med["peer_pp"],
        "tg_ours": n_decode / med["ours_tg"],
        "tg_peer": n_decode / med["peer_tg"],
        "pp_int8": n_pos / med["int8_pp"],
        "tg_int8": n_decode / med["int8_tg"],
    }


def agreement(path: Path, n_pos: int, threads: int) -> tuple[float, float]:
    """Top-1 agreement and mean KL(llama.cpp || moechat) over every position's logits."""
    import llama_cpp

    set_threads(threads)
    ours = load_model(path, n_ctx=n_pos + 8)
    ids = _ids(path, n_pos)
    peer = llama_cpp.Llama(str(path), n_ctx=n_pos + 8, n_batch=512, logits_all=True, n_threads=threads,
                           n_threads_batch=threads, verbose=False)  # fmt: skip
    peer.reset()
    peer.eval(ids)
    ref = np.array(peer.scores[:n_pos], dtype=np.float64)
    peer.close()
    with torch.inference_mode():
        got = ours.model(torch.tensor(ids), 0, ours.new_cache()).double().numpy()
    ours.close()
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = float((np.exp(lp) * (lp - lq)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())
    return top1, kl


def f32_copy(path: Path, out_dir: Path) -> Path:
    """The same model with every tensor dequantized to F32.

    On quantized weights llama.cpp's CPU kernels round the activations to 8 bits (Q8_0 or Q8_K
    blocks) before the dot products; moechat computes with exact fp32 activations. On an F32
    copy both do fp32 arithmetic, so what is left between them is the model code itself.
    """
    from gguf import GGUFWriter
    from moechat.engine.gguf.dequant import dequantize
    from moechat.engine.gguf.reader import GGUFFile, copy_metadata

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
    ap.add_argument("--arch", action="append", help="test models of this architecture only (repeatable)")
    ap.add_argument("--agreement-only", action="store_true", help="logits agreement, no speed runs")
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
        models = args.models or test_models(Path(tmp), args.logit_scale, args.arch)
        if args.f32_copy:
            models = [x for m in models for x in (m, f32_copy(m, Path(tmp)))]
        repeats = 0 if args.agreement_only else args.repeats
        rows = [compare(m, args.positions, args.decode, args.threads, repeats) for m in models]
    if args.agreement_only:
        print("| model | top-1 | mean KL |\n|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {100 * float(r['top1']):.1f}% | {float(r['kl']):.2e} |")
        return
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
