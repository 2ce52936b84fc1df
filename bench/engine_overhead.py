"""What the engine costs around the kernels at decode: the expert cache's bookkeeping, threads under load, a cold map.

    python bench/engine_overhead.py [--big QWEN3_SHAPED.gguf] [--tokens 48] [--rounds 2]
        [--skip-overhead] [--skip-onoff] [--skip-load] [--skip-cold]

1. The expert cache's bookkeeping per MoE layer per decode token, on the CPU device: its lookup, the
   policy's decision, the counters and the lookup log. Where the slots are the host copy the token runs
   the one-call kernels and the cache is told the token's lookups (`ExpertCache.account`, its time per
   token over the token's MoE layers); elsewhere each layer's call until it hands the layer to its
   execution path. Median and 95th percentile over `--tokens` decode steps at several sizes and
   shares, interleaved in one process. Models: the demo (16 experts, top-1), generated layers of 16
   to 256 experts at top-1 to top-8 (a DeepSeek-V3-sized router: 256 experts, top-8), and with --big
   the 12-layer Qwen3-30B-A3B-shaped model (bench/decode_vs_llamacpp.py --big generates one).
2. Decode t/s in-process, cache arms against cache off, on the demo and the --big model; then decode
   t/s of the demo (its default cache) quiet and with one core kept busy by another process,
   per thread setting (0: the default, which gives way to other processes).
3. A cold `moechat run` (a new process, the file in the page cache) against the same model decoded
   in-process after warm-up tokens, and the run's peak resident memory against the file's size.

The load average is printed with the tables: this machine is shared.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.engine.cache.settings import CacheSettings
from moechat.engine.generate import decode_one, prefill
from moechat.engine.loader import LoadedModel, load_model, set_threads

PROMPT = "The history of the harbour town begins with the fishermen who"


def bookkeeping(lm: LoadedModel, settings: CacheSettings, n_tokens: int) -> tuple[list[float], str]:
    """Microseconds of the cache's bookkeeping (lookup, policy, counters, lookup log) per MoE layer per decode
    token, with `settings`' cache (a new one) on the loaded model, and which path the cache took. Token calls:
    the time in `ExpertCache.account` (a token's lookups, all layers at once) over the layers it covered; the
    general path: each layer's call until it hands the layer to its execution path."""
    cache_obj = lm.set_cache(settings)
    assert cache_obj is not None
    cache = lm.new_cache()
    tok = int(prefill(lm.model, lm.tokenizer.encode(PROMPT)[:24], cache).argmax())
    for _ in range(8):
        tok = int(decode_one(lm.model, tok, cache).argmax())
    books: list[float] = []
    cls = type(cache_obj)
    if cache_obj.per_token:
        original: Any = cls.account
        token = [0.0, 0]  # this token's time in account so far, and its layers

        def account(self: Any, layers: Any, ids: Any) -> None:
            # Per token: a plan that runs its layers one by one tells the cache each layer as it goes, and
            # the cache steps them all at the last one; a tight loop tells it all at once.
            t = time.perf_counter()
            original(self, layers, ids)
            token[0] += time.perf_counter() - t
            token[1] += len(layers)
            if layers[-1] == self.last_layer:
                books.append(token[0] * 1e6 / token[1])
                token[:] = [0.0, 0]

        cls.account = account
        restore = ("account", original)
    else:
        in_path = [0.0]

        def timed_path(f: Callable[..., Any]) -> Callable[..., Any]:
            def run(*a: Any) -> Any:
                t = time.perf_counter()
                try:
                    return f(*a)
                finally:
                    in_path[0] += time.perf_counter() - t

            return run

        cache_obj._cached_path = {k: timed_path(f) for k, f in cache_obj._cached_path.items()}
        cache_obj._uncached_path = timed_path(cache_obj._uncached_path)
        original = cls.__call__

        def call(self: Any, *a: Any) -> Any:
            t, path_before = time.perf_counter(), in_path[0]
            r = original(self, *a)
            books.append((time.perf_counter() - t - (in_path[0] - path_before)) * 1e6)
            return r

        cls.__call__ = call
        restore = ("__call__", original)
    try:
        for _ in range(n_tokens):
            tok = int(decode_one(lm.model, tok, cache).argmax())
    finally:
        setattr(cls, *restore)
    return books, "token calls" if cache_obj.per_token else "per layer"


def loaded_expert_mib(lm: LoadedModel) -> float:
    """MiB of every routed expert of a loaded model."""
    return sum(lx.bytes_per_expert * lx.gate.raw.shape[0] for lx in lm.model.host_experts.layers.values()) / 2**20


def expert_mib(path: Path) -> float:
    lm = load_model(path, n_ctx=64)
    mib = loaded_expert_mib(lm)
    lm.close()
    return mib


def cpu_name() -> str:
    from llvmlite import binding as llvm

    feats = llvm.get_host_cpu_features()
    isa = [f for f in ("avx2", "avx512f", "avx512vnni", "avxvnni") if feats.get(f)]
    from moechat.engine.kernels import isa as kernel_isa

    return (f"{llvm.get_host_cpu_name()} ({', '.join(isa) or 'no AVX2'}), {os.cpu_count()} cores; "
            f"kernels: {kernel_isa.describe()}")  # fmt: skip


def p95(v: list[float]) -> float:
    return sorted(v)[int(0.95 * (len(v) - 1))]


def overhead_table(models: list[tuple[str, Path]], n_tokens: int, rounds: int) -> None:
    print("## The cache's bookkeeping per MoE layer per decode token (CPU device), microseconds\n")
    print("Lookup, policy, counters and lookup log; each model loaded once, its arms (a new cache each) "
          f"interleaved, {rounds} rounds. Goal: <= 10 us.\n")  # fmt: skip
    print("| model | cache | share | path | median | p95 |")
    print("|---|---|---:|---|---:|---:|")
    for label, path in models:
        lm = load_model(path, n_ctx=n_tokens + 64)
        mib = loaded_expert_mib(lm)
        arms = [(f"{int(f * 100)}%", CacheSettings(mib=f * mib, cpu_share=s)) for f in (0.25, 0.5)
                for s in (0.0, 0.5, 0.95)]  # fmt: skip
        got: list[list[float]] = [[] for _ in arms]
        kinds = [""] * len(arms)
        for _ in range(rounds):
            for i, (_, settings) in enumerate(arms):
                books, kinds[i] = bookkeeping(lm, settings, n_tokens)
                got[i].extend(books)
        lm.close()
        for (name, settings), books, kind in zip(arms, got, kinds, strict=True):
            print(f"| {label} | {name} | {settings.cpu_share:g} | {kind} | {statistics.median(books):.1f} "
                  f"| {p95(books):.1f} |", flush=True)  # fmt: skip


def timed_decode(lm: LoadedModel, n_tokens: int) -> float:
    """Decode t/s of `n_tokens` greedy tokens after the prompt and 4 untimed tokens, a new KV cache."""
    cache = lm.new_cache()
    tok = int(prefill(lm.model, lm.tokenizer.encode(PROMPT), cache).argmax())
    for _ in range(4):
        tok = int(decode_one(lm.model, tok, cache).argmax())
    t = time.perf_counter()
    for _ in range(n_tokens):
        tok = int(decode_one(lm.model, tok, cache).argmax())
    return n_tokens / (time.perf_counter() - t)


def decode_tps(path: Path, settings: CacheSettings | None, n_tokens: int, threads: int) -> float:
    set_threads(threads)
    lm = load_model(path, n_ctx=n_tokens + 64, cache=settings)
    tps = timed_decode(lm, n_tokens)
    lm.close()
    return tps


def onoff_table(models: list[tuple[str, Path]], n_tokens: int, rounds: int) -> None:
    """Decode t/s in-process with the cache on (25% and 50% of the experts, shares 0 and 0.5) against off:
    one model load, each arm a new cache (`set_cache`), arms interleaved `rounds` times, medians."""
    print("\n## Decode t/s in-process, cache arms against cache off (same run, arms interleaved), medians\n")
    print("| model | off t/s | 25%, share 0 | 25%, 0.5 | 50%, 0 | 50%, 0.5 |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, path in models:
        lm = load_model(path, n_ctx=n_tokens + 64)
        mib = loaded_expert_mib(lm)
        arms: list[CacheSettings | None] = [None] + [CacheSettings(mib=f * mib, cpu_share=s) for f in (0.25, 0.5)
                                                      for s in (0.0, 0.5)]  # fmt: skip
        got: list[list[float]] = [[] for _ in arms]
        for _ in range(rounds):
            for i, settings in enumerate(arms):
                lm.set_cache(settings)
                got[i].append(timed_decode(lm, n_tokens))
        lm.close()
        off = statistics.median(got[0])
        cells = " | ".join(f"{statistics.median(g) / off:.2f}x" for g in got[1:])
        print(f"| {label} | {off:.1f} | {cells} |", flush=True)


@contextmanager
def one_core_busy() -> Iterator[None]:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)
    try:
        yield
    finally:
        spin.kill()
        spin.wait()


def load_table(path: Path, n_tokens: int) -> None:
    settings = CacheSettings(mib=0.5 * expert_mib(path), cpu_share=0.5)
    print("\n## Decode t/s with one core busy (a spinning process), the demo with its default cache\n")
    print("| threads | quiet | one core busy | busy / quiet |")
    print("|---|---:|---:|---:|")
    for threads in (0, 1, 2):
        quiet = decode_tps(path, settings, n_tokens, threads)
        with one_core_busy():
            busy = decode_tps(path, settings, n_tokens, threads)
        name = f"{threads} (default)" if threads == 0 else str(threads)
        print(f"| {name} | {quiet:.1f} | {busy:.1f} | {busy / quiet:.2f} |", flush=True)
    set_threads(0)


def cold_table(path: Path, n_tokens: int, rounds: int) -> None:
    size = path.stat().st_size
    print(f"\n## A cold `moechat run` against a warm in-process decode ({path.name}, {size / 2**30:.2f} GiB)\n")
    print("| round | cold run t/s | warm in-process t/s | cold / warm | peak RSS / file | the map's RSS / file "
          "| cold, map not populated | its cold / warm |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    env = {**os.environ, "MOECHAT_CONFIG": os.devnull}
    for r in range(rounds):
        runs = []
        for populate in ("1", "0"):
            cmd = [sys.executable, "-c", _COLD_RUN, str(path), str(n_tokens), populate]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            m = re.search(r"generation: \d+ tokens, ([\d.]+) t/s", proc.stdout + proc.stderr)
            rss = int(re.search(r"maxrss (\d+)", proc.stdout).group(1)) * 1024  # type: ignore[union-attr]
            in_map = int(re.search(r"map rss (\d+)", proc.stdout).group(1))  # type: ignore[union-attr]
            runs.append((float(m.group(1)) if m else float("nan"), rss, in_map))
        warm = decode_tps(path, None, n_tokens, 0)
        (cold, rss, in_map), (bare, _, _) = runs
        print(f"| {r + 1} | {cold:.2f} | {warm:.2f} | {cold / warm:.2f} | {rss / size:.2f} | {in_map / size:.2f} "
              f"| {bare:.2f} "
              f"| {bare / warm:.2f} |", flush=True)  # fmt: skip


# `moechat run` as a user runs it (argv[3] "0": without the map populated ahead, for comparison), then
# its peak resident memory, and the file map's resident bytes at the end (from /proc/self/smaps, read
# before the process exits: `main` leaves the map to the garbage collector).
_COLD_RUN = """
import resource, sys
from pathlib import Path
def map_rss():
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line and not line[0].isupper():
            inside = line.rstrip().endswith(sys.argv[1])
        elif inside and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
    return rss
from moechat.engine.gguf.reader import GGUFFile
peak = [0]
close = GGUFFile.close
def measured_close(self):
    peak[0] = max(peak[0], map_rss())
    close(self)
GGUFFile.close = measured_close
from moechat.app.cli import main
if sys.argv[3] == "0":
    from moechat.engine.gguf.reader import GGUFFile
    GGUFFile.prefault = lambda self: None
try:
    main(["run", sys.argv[1], "-p", "The history of the harbour town", "-n", sys.argv[2], "--temp", "0",
          "--ignore-eos"])
except SystemExit:
    pass
print("maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
print("map rss", peak[0])
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", type=Path, default=None, help="the 12-layer Qwen3-30B-A3B-shaped GGUF")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-onoff", action="store_true")
    args = ap.parse_args()
    from moechat.app.paths import app_paths
    from moechat.demo.build import ensure_demo
    from testkit.ggufgen import Q, tiny_moe

    print(f"load average at start: {os.getloadavg()[0]:.2f}; CPU: {cpu_name()}\n")
    demo = ensure_demo(app_paths().cache)
    with tempfile.TemporaryDirectory() as tmp:
        models = [("demo (16 experts, top-1)", demo)]
        for n_expert, k in ((16, 1), (16, 8), (64, 4), (256, 8)):
            path = tiny_moe(Path(tmp) / f"m{n_expert}-{k}.gguf", n_layers=4, n_embd=512, n_head=8, n_expert=n_expert,
                            n_expert_used=k, n_ff_exp=256, expert_type=Q.Q4_K, n_vocab=2048)  # fmt: skip
            models.append((f"generated, {n_expert} experts, top-{k}", path))
        if args.big is not None:
            models.append(("Qwen3-30B-A3B-shaped, 12 layers (128, top-8)", args.big))
        set_threads(0)
        if not args.skip_overhead:
            overhead_table(models, args.tokens, args.rounds)
        if not args.skip_onoff:
            onoff_table([models[0], *models[-1:]] if args.big is not None else models[:1], args.tokens * 2,
                        args.rounds + 1)  # fmt: skip
        if not args.skip_load:
            load_table(demo, args.tokens)
        if not args.skip_cold:
            cold_table(args.big or demo, args.tokens, args.rounds)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
