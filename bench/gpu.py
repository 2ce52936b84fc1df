"""The CUDA path of the expert cache, checked and timed in one run on a machine with a GPU.

    python bench/gpu.py [--layers 2] [--tokens 64]      # prints Markdown; also writes $OUT/gpu.md if set

1. Upload speed: the same expert bytes copied host -> device from the file map (pageable) and from
   pinned memory, non_blocking on a side stream.
2. Overlap: the CPU part of a lookup (a worker thread) against the device part, and uploads on the
   copy stream against device compute.
3. The tests marked `cuda` (the compiled Triton kernels against gguf-py), run by pytest.
4. Correctness: greedy tokens with the cache on the GPU (two sizes, shares 0 and 0.5, Triton and
   eager device kernels) equal the tokens of the CPU reference.
5. Decode t/s for each of those, CUDA kernels launched per token (profiler), and t/s against the
   bound: uploaded bytes per token / link speed + bytes read on the device per token / HBM speed.
6. --moe-cache-mib auto: the size it gives from the free memory, the same greedy tokens, the memory
   left free after a decode, and the decode plan each layer ran.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.engine.cache.settings import CacheSettings
from moechat.engine.events import GREEDY, TokenEvent
from moechat.engine.generate import decode_one, generate, prefill
from moechat.engine.loader import LoadedModel, load_model
from moechat.engine.moe.host_experts import run_experts


def timed(fn: object, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def upload_speed(lm: LoadedModel) -> list[str]:
    lx = lm.model.host_experts.layers[0]
    src = lx.gate.raw  # memory-mapped, pageable
    pinned = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(src)
    dst = torch.empty(src.shape, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    n = src.numel()

    def copy(from_: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(from_, non_blocking=True)
        stream.synchronize()

    pageable_s, pinned_s = timed(lambda: copy(src)), timed(lambda: copy(pinned))
    return [
        "## Uploads (host -> device, one layer's gate experts)\n",
        "| source | MiB | GB/s |",
        "|---|---:|---:|",
        f"| file map (pageable) | {n / 2**20:.0f} | {n / pageable_s / 1e9:.1f} |",
        f"| pinned | {n / 2**20:.0f} | {n / pinned_s / 1e9:.1f} |",
        "",
    ]


def overlap(lm: LoadedModel) -> list[str]:
    lx = lm.model.host_experts.layers[0]
    act = lm.model.host_experts.act
    x = torch.randn(1, lm.config.n_embd, device="cuda")
    ids_h = torch.arange(lm.config.n_expert_used).reshape(1, -1)
    w = torch.full((1, lm.config.n_expert_used), 1.0 / lm.config.n_expert_used, device="cuda")
    experts = list(range(lm.config.n_expert_used))
    assert lm.cache is not None
    dev_fetch = lm.cache._host_fetch(lx)
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    xh, wh = x.cpu(), w.cpu()

    def device_part() -> None:
        run_experts(lx, x, ids_h, w, act, experts, fetch=dev_fetch)

    def cpu_part() -> None:
        run_experts(lx, xh, ids_h, wh, act, experts)

    def both() -> None:
        f = pool.submit(cpu_part)
        device_part()
        f.result()

    d, c, b = timed(device_part), timed(cpu_part), timed(both)
    return [
        f"## Overlap of the CPU part with the device part ({len(experts)} experts each)\n",
        "| device part ms | CPU part ms | both ms | overlap |",
        "|---:|---:|---:|---:|",
        f"| {d * 1e3:.2f} | {c * 1e3:.2f} | {b * 1e3:.2f} | {(d + c - b) / min(d, c):.0%} of the shorter part hidden |",
        "",
    ]


def greedy(lm: LoadedModel, prompt: list[int], n: int) -> list[int]:
    events = generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=n, params=GREEDY, ignore_eos=True)
    return [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]


def decode_tps(lm: LoadedModel, prompt: list[int], n: int) -> float:
    cache = lm.new_cache()
    tok = int(prefill(lm.model, prompt, cache).argmax())
    for _ in range(8):
        tok = int(decode_one(lm.model, tok, cache).argmax())
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        tok = int(decode_one(lm.model, tok, cache).argmax())
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t)


def hbm_gbps() -> float:
    """Device memory bandwidth: a 1 GiB device-to-device copy reads and writes each byte once."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a))
    return 2 * a.numel() / s / 1e9


def pinned_gbps(lm: LoadedModel) -> float:
    src = lm.model.host_experts.layers[0].gate.raw
    pinned = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(src.shape, dtype=torch.uint8, device="cuda")
    return src.numel() / timed(lambda: dst.copy_(pinned, non_blocking=True)) / 1e9


def kernels_per_token(lm: LoadedModel, prompt: list[int], n: int = 8) -> float:
    """CUDA kernels and copies per decode token, as the profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    cache = lm.new_cache()
    tok = int(prefill(lm.model, prompt, cache).argmax())
    for _ in range(4):
        tok = int(decode_one(lm.model, tok, cache).argmax())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            tok = int(decode_one(lm.model, tok, cache).argmax())
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA") / n


def bound_tps(lm: LoadedModel, link: float, hbm: float, dense_bytes: int) -> float:
    """The t/s the bytes allow: per token, what crossed the link at its speed plus what the device read."""
    assert lm.cache is not None
    total = lm.cache.snapshot().total
    per_expert = next(iter(lm.model.host_experts.layers.values())).bytes_per_expert
    upload = total.uploaded_bytes / max(total.tokens, 1)
    on_device = (total.lookups - total.cpu) * per_expert / max(total.tokens, 1) + dense_bytes
    return 1.0 / (upload / (link * 1e9) + on_device / (hbm * 1e9))


def cuda_tests() -> list[str]:
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"], cwd=root,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    last = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    return ["## Tests marked cuda\n", f"`pytest -m cuda`: {last} (exit {run.returncode})", ""]


def auto_size_check(path: Path, prompt: list[int], reference: list[int]) -> list[str]:
    """--moe-cache-mib auto on the GPU: what it sizes from the free memory, that it loads and decodes the CPU
    reference's tokens, and the memory CUDA reports free after a decode against the margin auto left."""
    from moechat.engine.cache.settings import AUTO_MIB

    torch.cuda.empty_cache()
    lm = load_model(path, n_ctx=512, cache=CacheSettings(mib=AUTO_MIB, device="cuda"))
    fit = lm.fit
    same = greedy(lm, prompt, 32) == reference
    free_after = torch.cuda.mem_get_info()[0] / 2**20
    described = lm.model.decode_plan(lm.new_cache()).describe()  # what a decode token ran (models.decode_plan)
    lm.close()
    out = ["\n## --moe-cache-mib auto\n"] + [f"- {line}" for line in (fit.lines() if fit else ["no fit"])]
    out.append(f"- decode plan: {described}")
    out.append(f"- same 32 tokens as the CPU: {'yes' if same else 'NO'}; free after a decode: {free_after:,.0f} MiB "
               f"(the margin was {fit.margin if fit else 0:,.0f} MiB)\n")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this script checks the CUDA path")
    from testkit.ggufgen import Q, tiny_moe

    lines = [f"# moechat CUDA check: {torch.cuda.get_device_name()} (torch {torch.__version__})\n"]
    with tempfile.TemporaryDirectory() as tmp:
        # Qwen3-30B-A3B expert shapes: 2048 hidden, 768 expert FFN, 128 experts, top-8.
        path = tiny_moe(Path(tmp) / "gpu.gguf", n_layers=args.layers, n_embd=2048, n_head=16, n_expert=128,
                        n_expert_used=8, n_ff_exp=768, expert_type=Q.Q4_K, n_vocab=4096)  # fmt: skip
        ref = load_model(path, n_ctx=512)
        prompt = ref.tokenizer.encode("The harbour was quiet that morning, and the boats")
        reference = greedy(ref, prompt, 32)
        expert_mib = sum(lx.bytes_per_expert * 128 for lx in ref.model.host_experts.layers.values()) / 2**20
        ref.close()

        lm = load_model(path, n_ctx=512, cache=CacheSettings(mib=0.1 * expert_mib, device="cuda"))
        lines += upload_speed(lm) + overlap(lm)
        lm.close()

        link, hbm = pinned_gbps(lm_probe := load_model(path, n_ctx=512)), hbm_gbps()
        dense_bytes = sum(t.n_bytes for name, t in lm_probe.gguf.tensors.items()
                          if (name.startswith("blk.") and "_exps" not in name) or name == "output.weight")  # fmt: skip
        lm_probe.close()
        lines += [f"Pinned upload {link:.1f} GB/s, device copy {hbm:.0f} GB/s.\n",
                  "## Greedy tokens on the GPU vs the CPU reference, decode speed and launches\n",
                  "| kernels | cache | share | load mode | same 32 tokens | decode t/s | bound t/s | of bound "
                  "| CUDA kernels per token |",
                  "|---|---:|---:|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for kernels in ("triton", "torch"):
            for frac in (0.1, 0.5):
                for share in (0.0, 0.5):
                    for mode in ("mmap", "pinned") if kernels == "triton" else ("pinned",):
                        settings = CacheSettings(mib=frac * expert_mib, cpu_share=share, device="cuda",
                                                 load_mode=mode, device_kernels=kernels)  # fmt: skip
                        lm = load_model(path, n_ctx=512, cache=settings)
                        same = greedy(lm, prompt, 32) == reference
                        tps = decode_tps(lm, prompt, args.tokens)
                        bound = bound_tps(lm, link, hbm, dense_bytes)
                        launches = kernels_per_token(lm, prompt)
                        lines.append(f"| {kernels} | {frac:.0%} | {share:g} | {mode} | {'yes' if same else 'NO'} "
                                     f"| {tps:.1f} | {bound:.0f} | {tps / bound:.0%} | {launches:.0f} |")  # fmt: skip
                        lm.close()
        lines += auto_size_check(path, prompt, reference)
        lines += cuda_tests()
    text = "\n".join(lines)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
