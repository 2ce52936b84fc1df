"""`moechat tune` and `moechat sim`: the tuner from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moechat.app.paths import app_paths
from moechat.app.settings import ENGINE
from moechat.tuner.events import SWEEP_MAX_CTX, SWEEP_TOKENS

if TYPE_CHECKING:
    from moechat.engine.cache.stats import CountersSnapshot
    from moechat.engine.loader import LoadedModel
    from moechat.tuner.events import NoiseCheck, SweepDone
    from moechat.tuner.simulator import Routing
    from moechat.tuner.sweep import SweepSettings
    from rich.console import Console

# A busy machine found by the noise check: checked again this many times, this far apart, then measured anyway.
NOISE_CHECKS, NOISE_WAIT_S = 3, 10.0


# The engine's settings a sweep runs with; it picks cache sizes and shares itself, and traces none.
TUNE_SETTINGS = tuple(
    n
    for n in ENGINE
    if n not in ("moe_cache_mib", "moe_cache_cpu_share", "moe_cache_policy", "moe_cache_prefetch", "moe_cache_trace")
)


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    from moechat.app.run_cmd import add_config_flag
    from moechat.app.settings import MODEL_HELP, add_flags

    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--max-mib", type=float, default=None, metavar="N", help="largest cache to consider, in MiB")
    p.add_argument("--tokens", type=int, default=SWEEP_TOKENS, metavar="N",
                   help=f"tokens generated per run (default {SWEEP_TOKENS})")  # fmt: skip
    p.add_argument(
        "--warmup", type=int, default=32, metavar="N", help="first tokens of a run left untimed (default 32)"
    )
    p.add_argument("--fresh", action="store_true", help="measure again instead of reusing earlier runs")
    p.add_argument("--save", action="store_true", help="keep the recommendation for this model: it applies whenever "
                   "this model file runs, above config.toml and below flags and MOECHAT_* variables")  # fmt: skip
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="Markdown tables")
    fmt.add_argument("--json", action="store_true", help="JSON")
    add_flags(p, TUNE_SETTINGS)
    add_config_flag(p)


def run_tune(args: argparse.Namespace) -> int:
    from moechat.app.settings import cache_settings, check_model_file, from_args, print_warnings

    # The same layering as `moechat run` (flag > env > config.toml > default), so the arms run
    # the engine as the user's sessions do; the sweep picks its own cache sizes and shares.
    layered, warnings, _ = from_args(args, TUNE_SETTINGS)
    print_warnings(warnings)
    check_model_file(args.model)  # bad values and files fail before the engine loads
    from moechat.app.demo_model import resolve_model
    from moechat.engine.loader import set_threads
    from moechat.tuner.events import Cancelled, SweepDone
    from moechat.tuner.recommend import recommend
    from moechat.tuner.report import render, to_json
    from moechat.tuner.sweep import SweepSettings, forget_runs, load_for_sweep
    from rich.console import Console

    if args.tokens < args.warmup + 8:
        raise ValueError(f"--tokens must be at least --warmup + 8 = {args.warmup + 8}, got {args.tokens}")
    if args.max_mib is not None and args.max_mib <= 0:
        raise ValueError(f"--max-mib must be > 0, got {args.max_mib}")
    base = cache_settings(layered)
    set_threads(layered.threads)  # the arms run in this process: their timings use these threads
    model = Path(resolve_model(args.model))
    settings = SweepSettings(
        model=model, device=base.device, n_ctx=min(layered.ctx_size, SWEEP_MAX_CTX),
        emulate_link_gbps=base.emulate_link_gbps, load_mode=base.load_mode, cpu_dequant_mib=layered.cpu_dequant_mib,
        cpu_kernels=layered.cpu_kernels,
        max_mib=args.max_mib, tokens=args.tokens, warmup=args.warmup,
    )  # fmt: skip
    cache_dir = app_paths().cache
    if args.fresh:
        forget_runs(settings, cache_dir)
    err = Console(stderr=True)
    stop = threading.Event()
    lm = load_for_sweep(settings)
    done: SweepDone | None = None
    try:
        # A busy machine is found before minutes of runs measure it: checked again after a wait,
        # then measured anyway (with the runs interleaved, steady other work costs every run alike).
        for attempt in range(1, NOISE_CHECKS + 2):
            check = attempt <= NOISE_CHECKS
            outcome = _sweep_with_bars(settings, cache_dir, stop, lm, check, err)
            if isinstance(outcome, SweepDone):
                done = outcome
                break
            if attempt < NOISE_CHECKS:
                err.print(f"moechat: the machine looks busy: {outcome.describe()}; checking again in "
                          f"{NOISE_WAIT_S:g} s (Ctrl+C stops)", markup=False, highlight=False)  # fmt: skip
                time.sleep(NOISE_WAIT_S)
            else:
                err.print(f"moechat: the machine still looks busy: {outcome.describe()}; measuring anyway, so the "
                          "runs may measure that other work too", markup=False, highlight=False)  # fmt: skip
    except (KeyboardInterrupt, Cancelled):
        stop.set()
        print("moechat: tune cancelled; finished runs are kept, unfinished ones are not", file=sys.stderr)
        return 130
    finally:
        lm.close()
    if done is None:  # the last sweep runs without a check, so it ends with its result or raises
        raise RuntimeError("the sweep ended without its result")
    report = recommend(done, model.name, workers=min(2, os.cpu_count() or 1))
    print(to_json(report) if args.json else render(report, markdown=args.markdown))
    if args.save:
        from moechat.app.tuned import file_identity, save_tuned

        rec = report.recommendation
        where = save_tuned(file_identity(model), model.name, rec.mib, rec.share)
        print(f"moechat: kept for {model.name} in {where}", file=sys.stderr)
    return 0  # a recommendation was printed; a doubtful fit is among its warnings


def _sweep_with_bars(settings: SweepSettings, cache_dir: Path, stop: threading.Event, lm: LoadedModel, check: bool,
                     err: Console) -> SweepDone | NoiseCheck:  # fmt: skip
    """One sweep with a progress bar per run: its SweepDone, or the NoiseCheck that stopped it."""
    from moechat.tuner.events import ArmDone, ArmProgress, ArmStarted, NoiseCheck, SweepDone, setting_words
    from moechat.tuner.report import duration, work_left
    from moechat.tuner.sweep import calibrate
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as bar:  # fmt: skip
        # A bar per run; on the CPU device the runs go together, a token of each in turn.
        tasks: dict[int, TaskID] = {}
        done_tokens: dict[int, int] = {}
        # The rate is taken from the tokens after every run's first (which reads the prompt and, on a first
        # start, waits for kernels): from the start it made 5 min 18 s of a 40 s sweep.
        base: tuple[float, int] | None = None
        estimated = False
        for ev in calibrate(settings, cache_dir=cache_dir, stop=stop, loaded=lm, check_noise=check):
            if isinstance(ev, NoiseCheck):
                if not ev.steady:
                    return ev
                bar.console.print(f"the machine looks steady: {ev.describe()}", markup=False, highlight=False)
            elif isinstance(ev, ArmStarted):
                tasks[ev.index] = bar.add_task(f"run {ev.index + 1}/{ev.n_arms}: {setting_words(ev.mib, ev.share)}",
                                               total=settings.tokens)  # fmt: skip
                done_tokens[ev.index] = 0
            elif isinstance(ev, ArmProgress) and ev.index in tasks:
                bar.update(tasks[ev.index], completed=ev.tokens_done)
                done_tokens[ev.index] = ev.tokens_done
                total = sum(done_tokens.values())
                if base is None and all(done_tokens.values()):
                    base = (time.monotonic(), total)
                elif base is not None and not estimated and total - base[1] >= max(8, ev.tokens_total // 8):
                    # The whole sweep's length, once the runs measured so far give a rate to go by.
                    estimated = True
                    rate = (total - base[1]) / max(time.monotonic() - base[0], 1e-6)
                    left, n_runs = work_left(done_tokens, ev.n_arms, ev.tokens_total)
                    bar.console.print(f"estimate: about {duration(left / rate)} for the {n_runs} runs left, "
                                      f"at {rate:.1f} tokens/s so far")  # fmt: skip
            elif isinstance(ev, ArmDone):
                a = ev.arm
                how = "reused" if ev.cached else f"{a.attempts} run(s)"
                hits = f", hits {100 * a.hit_rate:.0f}%" if not a.cache_off else ""
                bar.console.print(f"run {ev.index + 1}/{ev.n_arms}: {setting_words(a.mib, a.share)}: "
                                  f"{a.tps:.1f} t/s{hits} ({how})")  # fmt: skip
            elif isinstance(ev, SweepDone):
                return ev
    raise RuntimeError("the sweep ended without its result")  # calibrate ends with SweepDone, a NoiseCheck or raises


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="+", help="routing traces written with --moe-cache-trace, or another engine's "
                                            "route_trace v1 CSV (several: one session after another, of one "
                                            "model)")  # fmt: skip
    p.add_argument("--sizes", type=float, nargs="+", default=None, metavar="MIB",
                   help="cache sizes in MiB (default: 10%%..100%% of the experts)")  # fmt: skip
    p.add_argument("--shares", type=float, nargs="+", default=[0.0], metavar="F", help="CPU shares (default 0)")
    from moechat.engine.cache.policy import POLICIES
    from moechat.tuner.baselines import POLICIES as BASELINES

    p.add_argument("--policy", nargs="+", default=["classlru", "lru", "lfu", "min", "min-bypass"],
                   choices=[*POLICIES, *BASELINES], help="policies to compare: the engine's (--moe-cache-policy) "
                   "and the references")  # fmt: skip
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="first tokens not counted (default: a quarter of the trace, at most 64)")  # fmt: skip
    p.add_argument("--holdout", type=float, default=None, metavar="F",
                   help="score on the last F of the tokens only (the cache runs through the first part, whose "
                        "hit rate is shown beside)")  # fmt: skip
    p.add_argument("--reuse", action="store_true", help="also a reuse-distance histogram per layer")
    p.add_argument("--per-layer", action="store_true",
                   help="also each layer's hit rate beside MIN's on the same lookups, per size")  # fmt: skip
    p.add_argument("--prefetch", nargs="+", choices=["off", "next-layer"], default=None,
                   help="replay the engine's look-ahead: next-layer uploads each recorded prediction before its "
                        "layer's lookup, as the engine does (default: both where the trace holds predictions, "
                        "else off)")  # fmt: skip
    p.add_argument("--markdown", action="store_true", help="Markdown table")
    p.add_argument("--json", action="store_true",
                   help="a JSON object per line for each (policy, size, share, prefetch), not the table")  # fmt: skip


def run_sim(args: argparse.Namespace) -> int:
    from moechat.engine.cache.policy import POLICIES as ENGINE_POLICIES
    from moechat.engine.cache.stats import CountersSnapshot
    from moechat.tuner.baselines import BaselineResult, simulate_baseline
    from moechat.tuner.report import table
    from moechat.tuner.simulator import load_routing, replay

    for s in args.shares:
        if not 0 <= s <= 1:
            raise ValueError(f"--shares: {s} is outside [0, 1]")
    for path in args.trace:
        if not Path(path).is_file():
            raise ValueError(f"{path}: no such trace file")
    routing = load_routing(args.trace[0])
    for path in args.trace[1:]:
        try:
            routing = routing.concat(load_routing(path))
        except ValueError as e:
            raise ValueError(f"{path}: {e} ({args.trace[0]} is another)") from None
    n = routing.n_tokens
    # A fixed warm-up would leave a short trace almost nothing to score (64 of 67 tokens).
    if args.warmup is None:
        args.warmup = min(64, n // 4)
    if not 0 <= args.warmup < n:
        raise ValueError(f"--warmup {args.warmup} leaves none of the trace's {n} tokens to score")
    split = None  # held out: the tokens after `split` are scored, the first part warms the cache
    if args.holdout is not None:
        if not 0 < args.holdout < 1:
            raise ValueError(f"--holdout: {args.holdout} is not a fraction in (0, 1)")
        split = n - max(1, round(args.holdout * n))
        if split <= args.warmup:
            raise ValueError(f"--holdout {args.holdout:g} leaves the first part ({split} tokens) no more than the "
                             f"warm-up ({args.warmup})")  # fmt: skip
    scored_from = split if split is not None else args.warmup
    prefetches = args.prefetch or (["off", "next-layer"] if routing.predictions else ["off"])
    if "next-layer" in prefetches and not routing.predictions:
        raise ValueError(f"--prefetch next-layer: {args.trace[0]} holds no predictions (traces record them since "
                         "moechat 0.9; record it again)")  # fmt: skip
    full = routing.full_mib()
    sizes = args.sizes or [round(f * full, 3) for f in (0.1, 0.2, 0.3, 0.5, 0.75, 1.0)]
    for s in sizes:
        if s <= 0:
            raise ValueError(f"--sizes: {s} MiB is not a cache size")
    rows = []
    records: list[dict[str, object]] = []
    empty = [mib for mib in sizes if not any(routing.slots(mib))]
    for mib in sizes:
        slots = routing.slots(mib)
        if not any(slots):  # no slot fits: there is no cache to replay (its "0 misses" would read as perfect)
            continue
        base = {p: simulate_baseline(routing, slots, p, scored_from) for p in ("min", "min-bypass")}

        def ratio(misses: int, of: str, base: dict[str, BaselineResult] = base) -> str:
            m = base[of].misses
            return f"{misses / m:.2f}" if m else ("1.00" if misses == 0 else "inf")

        for policy in args.policy:
            if policy in ENGINE_POLICIES:
                for share in args.shares:
                    for pf in prefetches:
                        res = replay(routing, mib, share, warmup=scored_from, policy=policy, prefetch=pf)
                        t = res.total
                        if args.json:
                            records.append(sim_record(policy, mib, share, pf, t, res.upload_bytes + res.prefetch_bytes,
                                                      base["min"].misses))  # fmt: skip
                            continue
                        row = [
                            f"{mib:g}",
                            "/".join(map(str, slots)),
                            policy,
                            f"{share:g}",
                            pf,
                            f"{100 * t.hit_rate:.1f}%",
                            str(t.missed),
                            str(t.exposed),
                            ratio(t.exposed, "min"),
                            ratio(t.exposed, "min-bypass"),
                            f"{100 * t.recall:.0f}%" if t.predicted else "-",
                            "",
                        ]
                        if split is not None:
                            first = replay(routing, mib, share, warmup=args.warmup, until=split, policy=policy,
                                           prefetch=pf).total  # fmt: skip
                            row.append(f"{100 * first.hit_rate:.1f}%")
                        rows.append(row)
                continue
            b = base.get(policy) or simulate_baseline(routing, slots, policy, scored_from)
            if args.json:
                t = CountersSnapshot(lookups=b.lookups, hits=b.hits, misses=b.misses)
                records.append(sim_record(policy, mib, None, "off", t, None, base["min"].misses))
                continue
            rows.append([f"{mib:g}", "/".join(map(str, slots)), policy, "-", "off", f"{100 * b.hit_rate:.1f}%",
                         str(b.misses), str(b.misses), ratio(b.misses, "min"), ratio(b.misses, "min-bypass"), "-",
                         str(b.compulsory)] + ([""] if split is not None else []))  # fmt: skip
    if args.json:
        for r in records:
            print(json.dumps(r))
        return 0
    names = ", ".join(Path(t).name for t in args.trace)
    scored = f"held out: the last {n - split} scored" if split is not None else f"{n - args.warmup} scored"
    experts = (
        f"experts {full:.2f} MiB"
        if routing.stages is None
        else (
            f"split over {len(routing.stages)} hosts: sizes are each host's, the largest host's experts {full:.2f} MiB"
        )
    )
    print(f"{names}: {n} tokens, {sum(1 for r in routing.records if r[0] >= 0)} lookups, {experts}, "
          f"warm-up {args.warmup} tokens, {scored}")  # fmt: skip
    header = ["cache MiB", "slots", "policy", "share", "prefetch", "hit rate", "misses", "exposed",
              "exposed vs MIN", "vs MIN-bypass", "recall", "compulsory"]  # fmt: skip
    if split is not None:
        header.append(f"first part ({args.warmup}..{split})")
    print(table(header, rows, markdown=args.markdown))
    if empty:
        print(f"note: {', '.join(f'{s:g}' for s in empty)} MiB hold no expert slot (each layer needs at least "
              f"{routing.n_expert_used} of its experts): no cache to replay at that size")  # fmt: skip
    over = [f"{s:g}" for s in sizes if s > full]
    if over:
        print(f"note: {', '.join(over)} MiB exceed the trace's {full:.2f} MiB of experts: such a cache holds them all")
    if args.per_layer:
        print(per_layer_table(routing, sizes, scored_from, args, markdown=args.markdown))
    if args.reuse:
        print(reuse_table(routing, markdown=args.markdown))
    return 0


def sim_record(policy: str, mib: float, share: float | None, prefetch: str, t: CountersSnapshot,
               moved: int | None, min_misses: int) -> dict[str, object]:  # fmt: skip
    """One (policy, size, share, prefetch) of `moechat sim --json`: misses are lookups whose expert was not in a
    slot before its layer's prefetch, exposed those a prefetch did not fetch either (what a token waits for);
    uploaded_mib counts demand uploads and prefetches; min_misses is Belady MIN's on the same lookups and size."""
    return {
        "policy": policy,
        "size_mib": round(mib, 3),
        "share": share,
        "prefetch": prefetch,
        "lookups": t.lookups,
        "hits": t.hits,
        "misses": t.missed,
        "exposed": t.exposed,
        "prefetched": t.prefetched,
        "prefetch_hits": t.prefetch_hits,
        "recall": round(t.recall, 4) if t.predicted else None,
        "uploaded_mib": None if moved is None else round(moved / 2**20, 3),
        "min_misses": min_misses,
    }


def per_layer_table(routing: Routing, sizes: list[float], scored_from: int, args: argparse.Namespace,
                    markdown: bool = False) -> str:  # fmt: skip
    """Per layer and size: the hit rate of each engine policy asked for (at the first share) beside MIN's,
    so a user sees which layers lose."""
    from moechat.engine.cache.policy import POLICIES as ENGINE_POLICIES
    from moechat.tuner.baselines import simulate_baseline
    from moechat.tuner.report import table
    from moechat.tuner.simulator import replay

    policies = [p for p in args.policy if p in ENGINE_POLICIES] or ["classlru"]
    header = ["layer"] + [f"{p} / MIN @ {mib:g}" for mib in sizes for p in policies]
    cells: dict[int, list[str]] = {}
    for mib in sizes:
        best = {layer: (n, h) for layer, n, h in
                simulate_baseline(routing, routing.slots(mib), "min", scored_from).by_layer}  # fmt: skip
        for p in policies:
            res = replay(routing, mib, args.shares[0], warmup=scored_from, policy=p)
            for layer, counters in sorted(res.layers.items()):
                t = counters.total
                n, h = best.get(layer, (0, 0))
                ours = f"{100 * t.hit_rate:.0f}%" if t.lookups else "-"
                cells.setdefault(layer, []).append(f"{ours} / {100 * h / n:.0f}%" if n else f"{ours} / -")
    rows = [[str(layer), *c] for layer, c in sorted(cells.items())]
    return "hit rate per layer, the policy's beside MIN's on the same lookups\n" + table(header, rows, markdown)


def reuse_table(routing: Routing, markdown: bool = False) -> str:
    """Per layer, how many selections came back after how many distinct other experts (LRU stack distance)."""
    from moechat.tuner.report import table
    from moechat.tuner.routing_stats import distance_buckets, reuse_distances

    rows, header = [], ["layer"]
    for g in routing.groups:
        for layer in g.layers:
            buckets = distance_buckets(reuse_distances(routing.layer_steps(layer)), g.n_expert)
            header = ["layer", *(f"d {name}" for name, _ in buckets)]
            total = max(1, sum(n for _, n in buckets))
            rows.append([str(layer), *(f"{100 * n / total:.0f}%" for _, n in buckets)])
    return "reuse distance (distinct experts of the layer between two uses; an LRU of c slots per layer hits d < c)\n" \
        + table(header, rows, markdown=markdown)  # fmt: skip
