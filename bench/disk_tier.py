"""A model larger than RAM: moechat's RAM tier against ik_llama.cpp, side by side, page cache dropped before each run.

    python bench/disk_tier.py --big Q96.gguf [--small Q12.gguf] [--ik DIR] [--rounds 3]
                              [--trace ../shared/data/real-routing/gemma.route.csv]

Needs root (drops the page cache with /proc/sys/vm/drop_caches). Writes nothing to the models.

1. Disk: random direct reads of whole experts of `--big` (its three slices, 8 experts in flight), the
   tier's own reader, for `--probe-gib` GiB: GB/s at expert-sized reads.
2. Side by side, alternating rounds, each run a fresh process after the page cache was dropped, the
   same raw prompt, greedy, `-n 8`, two threads: ik_llama.cpp `llama-cli` with its defaults, with
   `--prefetch-experts`, and with that at moechat's context (`-c 4096`), and `moechat run` with its
   defaults. Per run: decode t/s (tokens after the first over their time, as both print it), load
   plus prompt (wall time less decode), peak RSS.
3. Real routing (`--bench-replay-routing TRACE`, the text is not the model's), 48 tokens: the big file with
   its defaults, and `--small` with `--emulate-host-mib` at 10% and 25% of its experts; each read on demand
   only (the model's own router cannot predict the trace) and with look-ahead by an emulated predictor of
   `--recall`. Per run: MiB read per decode token, the t/s those bytes bound at the probe's speed, and the
   share of that bound reached.

Prints tables with medians, the machine's load before the runs and the CPU's instructions.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import wait
from pathlib import Path

import numpy as np

PROMPT = "The history of the city begins"
OURS = re.compile(r"prompt: (\d+) tokens, ([\d.]+) t/s \| generation: (\d+) tokens, ([\d.]+) t/s")
DECODE_READS = re.compile(r"RAM tier in decode: ([\d.]+) MiB read per token")
IK_EVAL = re.compile(r"(?:llama_print_timings|main):\s+eval time =\s+([\d.]+) ms /\s+(\d+) (?:runs|tokens)")
IK_PROMPT = re.compile(r"(?:llama_print_timings|main): prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run(cmd: list[str]) -> tuple[str, float, float]:
    """A command's output, its wall seconds and its peak RSS in GiB (from the kernel's accounting of the child)."""
    drop_caches()
    t = time.perf_counter()
    # (in the temporary folder: llama-cli writes its main.log where it runs)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                         cwd=tempfile.gettempdir())  # fmt: skip
    out = p.stdout.read() if p.stdout is not None else ""
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}\n{out[-3000:]}")
    return out, wall, usage.ru_maxrss / 2**20


def moechat() -> list[str]:
    exe = Path(sys.executable).with_name("moechat")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "moechat.app.cli"]


def ours(model: Path, n: int, extra: list[str]) -> dict[str, float]:
    out, wall, rss = run([*moechat(), "run", str(model), "--raw", "-p", PROMPT, "-n", str(n), "--temp", "0",
                          "--ignore-eos", "-t", "2", *extra])  # fmt: skip
    m = OURS.search(out)
    if m is None:
        sys.exit(f"no speeds in moechat's output:\n{out[-2000:]}")
    n_gen, tps = int(m.group(3)), float(m.group(4))
    decode_s = (n_gen - 1) / tps if tps else 0.0
    reads = DECODE_READS.search(out)
    return {"decode": tps, "load+prompt": wall - decode_s, "rss": rss, "wall": wall,
            "mib_per_token": float(reads.group(1)) if reads else 0.0}  # fmt: skip


def ik(cli: Path, model: Path, n: int, extra: list[str]) -> dict[str, float]:
    cmd = [str(cli), "-m", str(model), "-t", "2", "--temp", "0", "-n", str(n), "-p", PROMPT, "--ignore-eos"]
    out, wall, rss = run(cmd + extra)
    e, p = IK_EVAL.search(out), IK_PROMPT.search(out)
    if e is None or p is None:
        sys.exit(f"no timings in llama-cli's output:\n{out[-2000:]}")
    ms, runs = float(e.group(1)), int(e.group(2))
    tps = 1e3 * runs / ms if ms else 0.0
    return {"decode": tps, "load+prompt": wall - ms / 1e3, "rss": rss, "wall": wall, "mib_per_token": 0.0}


def probe(model: Path, gib: float) -> float:
    """GB/s of random direct reads of whole experts (three slices each), 8 experts in flight."""
    from moechat.engine.gguf.direct_read import DirectReader
    from moechat.engine.gguf.reader import GGUFFile

    with GGUFFile(model) as g:
        names = sorted(n for n in g.tensors if "_exps." in n)
        spans = []
        for n in names:
            t = g.tensors[n]
            per = t.n_bytes // t.shape[0]
            spans.append((t.offset, per, t.shape[0]))
        path = g.shard_path(0)
    reader = DirectReader([path])
    rng = random.Random(0)
    per_expert = sum(s[1] for s in spans[:3])
    n_experts = int(gib * 2**30 / per_expert)
    bufs = [np.empty(max(s[1] for s in spans), np.uint8) for _ in range(3 * 8)]
    drop_caches()
    t = time.perf_counter()
    done = 0
    while done < n_experts:
        futures = []
        for j in range(8):
            layer = rng.randrange(len(spans) // 3)
            e = rng.randrange(spans[0][2])
            for k in range(3):
                off, per, _ = spans[3 * layer + k]
                futures += reader.submit(0, off + e * per, bufs[3 * j + k][:per])
        wait(futures)
        for f in futures:
            f.result()
        done += 8
    seconds = time.perf_counter() - t
    reader.close()
    return done * per_expert / seconds / 1e9


def load_line() -> str:
    one, five, _ = os.getloadavg()
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "SSE"
    mem = Path("/proc/meminfo").read_text().split("\n")[0]
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min); {os.cpu_count()} CPUs, {isa}; {mem}"


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", type=Path, required=True)
    ap.add_argument("--small", type=Path)
    ap.add_argument("--ik", type=Path, default=Path("/tmp/ik_llama/build/bin"))
    ap.add_argument(
        "--trace", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/real-routing/gemma.route.csv"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--recall", type=float, default=0.85,
                    help="the emulated predictor's recall in the replay (about what a layer's router on the previous "
                         "layer's output reaches one layer ahead on Qwen3-30B-A3B, as published)")  # fmt: skip
    ap.add_argument("--probe-gib", type=float, default=2.0)
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--skip-replay", action="store_true")
    args = ap.parse_args()
    print(load_line())
    gbps = probe(args.big, args.probe_gib)
    print(f"disk: {gbps:.2f} GB/s in random direct reads of whole experts, 8 in flight")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"{args.big.name}: {args.big.stat().st_size / 2**30:.1f} GiB; RAM {ram:.1f} GiB")
    if not args.skip_peers:
        arms = {"moechat": lambda: ours(args.big, 8, [])}
        cli = args.ik / "llama-cli"
        if cli.exists():
            arms["ik_llama.cpp"] = lambda: ik(cli, args.big, 8, [])
            arms["ik_llama.cpp --prefetch-experts"] = lambda: ik(cli, args.big, 8, ["--prefetch-experts"])
            # Its default context is the model's (40960 here): a KV cache of GiBs beside the page cache. moechat's
            # default is 4096; the same context for both, too.
            arms["ik_llama.cpp --prefetch-experts -c 4096"] = lambda: ik(
                cli, args.big, 8, ["--prefetch-experts", "-c", "4096"]
            )
        results: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
        for r in range(args.rounds):
            for name, arm in arms.items():
                results[name].append(arm())
                print(f"  round {r + 1} {name}: {results[name][-1]}", flush=True)
        base = "ik_llama.cpp --prefetch-experts" if "ik_llama.cpp --prefetch-experts" in results else None
        print(
            "\n| | decode t/s (median) | load + prompt s | peak RSS GiB (% of RAM) | decode vs ik --prefetch-experts |"
        )
        print("|---|---|---|---|---|")
        for name, rows in results.items():
            ratio = f"{med(rows, 'decode') / med(results[base], 'decode'):.2f}x" if base else "-"
            print(
                f"| {name} | {med(rows, 'decode'):.2f} ({min(r['decode'] for r in rows):.2f}-"
                f"{max(r['decode'] for r in rows):.2f}) | {med(rows, 'load+prompt'):.1f} | "
                f"{med(rows, 'rss'):.1f} ({100 * med(rows, 'rss') / ram:.0f}%) | {ratio} |"
            )
    if args.skip_replay:
        return
    replay = ["--bench-replay-routing", str(args.trace)]
    cases: list[tuple[str, Path, list[str]]] = [(f"{args.big.name}, defaults", args.big, [])]
    if args.small is not None:
        from moechat.engine.cache import ram_size
        from moechat.engine.config import model_config
        from moechat.engine.gguf.reader import GGUFFile

        with GGUFFile(args.small) as g:
            fit = ram_size.plan(g, model_config(g), 4096, 0)
        for share in (0.10, 0.25):
            host = (fit.dense + fit.kv + fit.scratch + share * fit.experts) / 2**20
            cases.append((f"{args.small.name}, tier {share:.0%}", args.small, ["--emulate-host-mib", f"{host:.0f}"]))
    print("\nreal routing replayed from", args.trace.name, "(48 tokens; medians of", args.rounds, "runs)")
    print("| | look-ahead | MiB read per decode token | bound t/s at the probe's speed | decode t/s | of the bound |")
    print("|---|---|---|---|---|---|")
    for name, path, extra in cases:
        for ahead in ("0", str(args.recall)):
            flags = [*replay, *extra, "--bench-replay-recall", ahead]
            rows = [ours(path, 48, flags) for _ in range(args.rounds)]
            mib = med(rows, "mib_per_token")
            bound = gbps * 1e9 / (mib * 2**20) if mib else float("inf")
            tps = med(rows, "decode")
            how = "none (demand reads)" if ahead == "0" else f"emulated, recall {ahead}"
            print(f"| {name} | {how} | {mib:.0f} | {bound:.2f} | {tps:.2f} | {100 * tps / bound:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
