"""`moechat run`: generate from a prompt on the command line, streaming to stdout."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from moechat.app.settings import (
    ENGINE,
    MODEL_HELP,
    SAMPLING,
    Settings,
    add_flags,
    cache_settings,
    check_model_file,
    from_args,
    print_warnings,
    sampling_params,
)

if TYPE_CHECKING:
    from moechat.engine.cache.stats import StatsSnapshot, TierSnapshot
    from moechat.engine.generate import Model
    from moechat.engine.loader import LoadedModel


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="PATH", help="config.toml to read (default: the config dir's)")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("-p", "--prompt", required=True, help="the prompt")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None, help="prompt as one user turn")
    mode.add_argument("--raw", dest="chat", action="store_false", help="prompt as given (BOS per the model)")
    p.add_argument("--bench-replay-routing", metavar="TRACE", default=None,
                   help="benchmarks only: take each token's experts from a recorded routing trace (route_trace "
                        "CSV or --moe-cache-trace) instead of the router, to measure the tiers under real routing "
                        "on a generated model; the text is not the model's")  # fmt: skip
    p.add_argument("--bench-replay-recall", metavar="R", type=float, default=0.0,
                   help="benchmarks only, with --bench-replay-routing: look ahead with an emulated predictor that "
                        "names the trace's next experts at this rate (0 = read on demand only)")  # fmt: skip
    add_flags(p, (*SAMPLING, *ENGINE))
    add_config_flag(p)


class StatusLine:
    """What a command line's load is doing, on stderr: one line rewritten in place on a terminal, and on
    a pipe the first note and the last (a first start compiles dozens of kernels)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.notes = 0
        self.last = ""

    def __call__(self, text: str) -> None:
        self.notes += 1
        self.last = text
        if self.tty:
            sys.stderr.write(f"\r\x1b[Kmoechat: {text}")
            sys.stderr.flush()
        elif self.notes == 1:
            print(f"moechat: {text}", file=sys.stderr)

    def done(self) -> None:
        if self.tty and self.notes:
            sys.stderr.write("\r\x1b[K")
        elif self.notes > 1:
            print(f"moechat: {self.last}, done", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    settings, warnings, _ = from_args(args, (*SAMPLING, *ENGINE))
    print_warnings(warnings)
    sampling_params(settings)  # bad values and files fail before the engine loads
    check_model_file(args.model)
    from moechat.app.demo_model import resolve_model
    from moechat.app.real_engine import load_for
    from moechat.engine.distributed import launched

    if launched() is not None:
        from moechat.app.split_run import run_as_rank

        return run_as_rank(args.model, settings, lambda pm, lm, _id, _cache: reply(args, settings, lm, pm, pm.snapshot))
    from moechat.app.paths import app_paths
    from moechat.app.tuned import identity_of

    path = resolve_model(args.model)
    identity = identity_of(path)
    # Warm start where the app or line mode saved this model's expert use counts (kept up to date by this run).
    warm = app_paths().data / "warm" / f"{identity}.json" if identity else None
    status = StatusLine()
    lm = load_for(path, settings, cache_settings(settings, warm if warm is not None and warm.is_file() else None),
                  status, first_start=not args.bench_replay_routing)  # fmt: skip
    status.done()
    try:
        if args.bench_replay_routing:
            replay_routing(lm, args.bench_replay_routing, args.bench_replay_recall)
        elif args.bench_replay_recall:
            raise ValueError("--bench-replay-recall goes with --bench-replay-routing")
        code = reply(args, settings, lm, lm.runner, lambda: lm.cache.snapshot() if lm.cache is not None else None)
        if lm.first_start is not None and lm.first_start.compiling():
            print("first start: the kernels keep compiling in the background for the next start (a minute or two)",
                  file=sys.stderr)  # fmt: skip
        return code
    finally:
        lm.close()


def replay_routing(lm: LoadedModel, trace: str, recall: float = 0.0) -> None:
    """The bench switch: the model's experts chosen by `trace` (engine.cache.replay), said on stderr."""
    from moechat.engine.cache.replay import ReplayedRouting

    if not lm.config.is_moe or not lm.model.host_experts.layers:
        raise ValueError("--bench-replay-routing: the model has no experts to route")
    model = lm.model
    replay = ReplayedRouting(model.experts, trace, sorted(model.host_experts.layers), lm.config.n_expert, recall)
    model.experts = replay
    model.drop_plans()
    ahead = f"; look-ahead by an emulated predictor of recall {recall:g}" if replay.prefetch_tokens else ""
    print(f"moechat: routing replayed from {trace} ({len(replay.tokens)} tokens, {len(replay.trace_layers)} "
          f"layers{ahead}): the text is not the model's", file=sys.stderr)  # fmt: skip


def decode_reads(before: TierSnapshot, after: TierSnapshot, n_tokens: int) -> str:
    """What the RAM tier read and waited for per decode token after the first (the first came with the prompt)."""
    read = (after.bytes_read - before.bytes_read) / n_tokens
    wait = (after.wait_s - before.wait_s) / n_tokens
    return (
        f"RAM tier in decode: {read / 2**20:.1f} MiB read per token ({after.reads - before.reads} experts on "
        f"demand, {after.prefetched - before.prefetched} ahead), {1e3 * wait:.0f} ms per token waiting on the disk"
    )


def reply(args: argparse.Namespace, settings: Settings, lm: LoadedModel, model: Model,
          snapshot: Callable[[], StatsSnapshot | None]) -> int:  # fmt: skip
    """The prompt's reply from `model` (the loaded model, or a split's pipeline on its rank 0), streamed to
    stdout, the speeds and the cache's summary (`snapshot`) on stderr. The exit status."""
    from moechat.engine.cache.stats import summary_lines
    from moechat.engine.events import DoneEvent, TokenEvent
    from moechat.engine.generate import generate

    params = sampling_params(settings)
    plain = lm.template.origin == "plain fallback"
    chat = args.chat if args.chat is not None else not plain
    if chat and plain:
        print("moechat: warning: the model has no usable chat template: the prompt is one 'User:' turn of a plain "
              "format (--raw sends it as given)", file=sys.stderr)  # fmt: skip
    prompt = lm.chat_prompt(args.prompt) if chat else lm.tokenizer.encode(args.prompt)
    stop = threading.Event()
    out = sys.stdout
    tier = lm.ram_tier
    after_prompt = None  # the RAM tier's counters at the first token: what decode read is the rest
    try:
        for ev in generate(model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=settings.n_predict,
                           params=params, ignore_eos=args.ignore_eos, stop=stop):  # fmt: skip
            if isinstance(ev, TokenEvent):
                if after_prompt is None and tier is not None:
                    after_prompt = tier.snapshot()
                out.write(ev.text)
                out.flush()
            elif isinstance(ev, DoneEvent):
                out.write("\n")
                print(
                    f"prompt: {ev.n_prompt} tokens, {ev.prompt_tps:.1f} t/s | "
                    f"generation: {ev.n_generated} tokens, {ev.gen_tps:.1f} t/s | stop: {ev.stop_reason}",
                    file=sys.stderr,
                )
                snap = snapshot()
                if snap is not None:
                    for line in summary_lines(snap):
                        print(line, file=sys.stderr)
                if tier is not None:
                    now = tier.snapshot()
                    for line in now.lines():
                        print(line, file=sys.stderr)
                    if after_prompt is not None and ev.n_generated > 1:
                        print(decode_reads(after_prompt, now, ev.n_generated - 1), file=sys.stderr)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as other command-line tools do.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        print("moechat: interrupted", file=sys.stderr)
        return 130
    return 0
