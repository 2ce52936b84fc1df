"""`moechat tune` and `moechat sim`: the tuner from the command line."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from .paths import app_paths


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    from .run_cmd import add_cache_arguments
    from .settings import MODEL_HELP

    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--max-mib", type=float, default=None, metavar="N", help="largest cache to consider, in MiB")
    p.add_argument("--tokens", type=int, default=256, metavar="N", help="tokens generated per run (default 256)")
    p.add_argument(
        "--warmup", type=int, default=32, metavar="N", help="first tokens of a run left untimed (default 32)"
    )
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size (default 2048)")
    p.add_argument("--fresh", action="store_true", help="measure again instead of reusing earlier runs")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="Markdown tables")
    fmt.add_argument("--json", action="store_true", help="JSON")
    add_cache_arguments(p, sweep=True)


def run_tune(args: argparse.Namespace) -> int:
    from moechat.engine.loader import set_threads
    from moechat.tuner.recommend import recommend
    from moechat.tuner.report import render, to_json
    from moechat.tuner.sweep import (
        ArmDone,
        ArmProgress,
        ArmStarted,
        Cancelled,
        SweepDone,
        SweepSettings,
        calibrate,
        forget_runs,
    )  # fmt: skip
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .demo_model import resolve_model
    from .run_cmd import layered_settings

    if args.tokens < args.warmup + 8:
        raise ValueError(f"--tokens must be at least --warmup + 8 = {args.warmup + 8}, got {args.tokens}")
    if args.max_mib is not None and args.max_mib <= 0:
        raise ValueError(f"--max-mib must be > 0, got {args.max_mib}")
    # The same layering as `moechat run` (flag > env > config.toml > default), so the arms run
    # the engine as the user's sessions do; the sweep picks its own cache sizes and shares.
    opts = layered_settings(args)
    set_threads(opts.threads)  # the arms run in this process: their timings use these threads
    model = Path(resolve_model(args.model))
    settings = SweepSettings(
        model=model, device=opts.cache.device, n_ctx=args.ctx_size, emulate_link_gbps=opts.cache.emulate_link_gbps,
        load_mode=args.load_mode, cpu_dequant_mib=opts.cpu_dequant_mib, cpu_kernels=opts.cpu_kernels,
        max_mib=args.max_mib, tokens=args.tokens, warmup=args.warmup,
    )  # fmt: skip
    cache_dir = app_paths().cache
    if args.fresh:
        forget_runs(settings, cache_dir)
    err = Console(stderr=True)
    stop = threading.Event()
    done = None
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as bar:  # fmt: skip
        task = None
        try:
            for ev in calibrate(settings, cache_dir=cache_dir, stop=stop):
                if isinstance(ev, ArmStarted):
                    task = bar.add_task(f"run {ev.index + 1}/{ev.n_arms}: cache {ev.mib:g} MiB, share {ev.share:g}",
                                        total=settings.tokens)  # fmt: skip
                elif isinstance(ev, ArmProgress) and task is not None:
                    bar.update(task, completed=ev.tokens_done)
                elif isinstance(ev, ArmDone):
                    a = ev.arm
                    how = "reused" if ev.cached else f"{a.attempts} run(s)"
                    bar.console.print(f"run {ev.index + 1}/{ev.n_arms}: cache {a.mib:g} MiB, share {a.share:g}: "
                                      f"{a.tps:.1f} t/s, hits {100 * a.hit_rate:.0f}% ({how})")  # fmt: skip
                elif isinstance(ev, SweepDone):
                    done = ev
        except (KeyboardInterrupt, Cancelled):
            stop.set()
            print("moechat: tune cancelled; finished runs are kept, the unfinished one is not", file=sys.stderr)
            return 130
    assert done is not None  # calibrate ends with SweepDone or raises
    report = recommend(done, model.name, workers=min(2, os.cpu_count() or 1))
    print(to_json(report) if args.json else render(report, markdown=args.markdown))
    return 0 if report.time_model.trustworthy else 3


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a routing trace written with --moe-cache-trace")
    p.add_argument("--sizes", type=float, nargs="+", default=None, metavar="MIB",
                   help="cache sizes in MiB (default: 10%%..100%% of the experts)")  # fmt: skip
    p.add_argument("--shares", type=float, nargs="+", default=[0.0], metavar="F", help="CPU shares (default 0)")
    p.add_argument("--policy", nargs="+", default=["classlru", "lru", "lfu", "min", "min-bypass"],
                   choices=["classlru", "lru", "lfu", "min", "min-bypass"], help="policies to compare")  # fmt: skip
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="first tokens not counted (default: a quarter of the trace, at most 64)")  # fmt: skip
    p.add_argument("--markdown", action="store_true", help="Markdown table")


def run_sim(args: argparse.Namespace) -> int:
    from moechat.tuner.baselines import BaselineResult, simulate_baseline
    from moechat.tuner.report import table
    from moechat.tuner.simulator import load_routing, replay

    for s in args.shares:
        if not 0 <= s <= 1:
            raise ValueError(f"--shares: {s} is outside [0, 1]")
    routing = load_routing(args.trace)
    # A fixed warm-up would leave a short trace almost nothing to score (64 of 67 tokens).
    if args.warmup is None:
        args.warmup = min(64, routing.n_tokens // 4)
    if not 0 <= args.warmup < routing.n_tokens:
        raise ValueError(f"--warmup {args.warmup} leaves none of the trace's {routing.n_tokens} tokens to score")
    full = routing.full_mib()
    sizes = args.sizes or [round(f * full, 3) for f in (0.1, 0.2, 0.3, 0.5, 0.75, 1.0)]
    for s in sizes:
        if s <= 0:
            raise ValueError(f"--sizes: {s} MiB is not a cache size")
    rows = []
    for mib in sizes:
        slots = routing.slots(mib)
        base = {p: simulate_baseline(routing, slots, p, args.warmup) for p in ("min", "min-bypass")}

        def ratio(misses: int, of: str, base: dict[str, BaselineResult] = base) -> str:
            m = base[of].misses
            return f"{misses / m:.2f}" if m else ("1.00" if misses == 0 else "inf")

        for policy in args.policy:
            if policy == "classlru":
                for share in args.shares:
                    res = replay(routing, mib, share, warmup=args.warmup)
                    t = res.total
                    rows.append([f"{mib:g}", "/".join(map(str, slots)), "classlru", f"{share:g}",
                                 f"{100 * t.hit_rate:.1f}%", str(t.misses), ratio(t.misses, "min"),
                                 ratio(t.misses, "min-bypass"), ""])  # fmt: skip
                continue
            b = base.get(policy) or simulate_baseline(routing, slots, policy, args.warmup)
            rows.append([f"{mib:g}", "/".join(map(str, slots)), policy, "-", f"{100 * b.hit_rate:.1f}%", str(b.misses),
                         ratio(b.misses, "min"), ratio(b.misses, "min-bypass"), str(b.compulsory)])  # fmt: skip
    print(f"{Path(args.trace).name}: {routing.n_tokens} tokens, {len(routing.records)} lookups, "
          f"experts {full:.2f} MiB, warm-up {args.warmup} tokens, {routing.n_tokens - args.warmup} scored")  # fmt: skip
    header = ["cache MiB", "slots", "policy", "share", "hit rate", "misses", "vs MIN", "vs MIN-bypass", "compulsory"]
    print(table(header, rows, markdown=args.markdown))
    over = [f"{s:g}" for s in sizes if s > full]
    if over:
        print(f"note: {', '.join(over)} MiB exceed the trace's {full:.2f} MiB of experts: such a cache holds them all")
    return 0
