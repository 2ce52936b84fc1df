"""`moechat run`: generate from a prompt on the command line, streaming to stdout."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moechat.engine.kernel_modes import KERNEL_MODES
from moechat.engine.kernel_modes import describe as describe_kernel_modes

from .settings import DEMO_DEFAULTS, MODEL_HELP, Settings, demo_name, for_demo, resolve

if TYPE_CHECKING:  # the engine (torch) loads when a command runs, not for --help
    from moechat.engine.expert_cache import CacheSettings


def add_cache_arguments(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The engine's flags; `sweep`: for `tune`, which picks the cache sizes and shares itself."""
    p.add_argument("--device", default=None, help="auto, cuda or cpu (env MOECHAT_DEVICE)")
    if not sweep:
        p.add_argument(
            "--moe-cache-mib",
            type=float,
            default=None,
            metavar="N",
            help="device expert cache in MiB, fractions allowed; 0 = off (env MOECHAT_MOE_CACHE_MIB)",
        )
        p.add_argument(
            "--moe-cache-cpu-share",
            type=float,
            default=None,
            metavar="F",
            help="share of the misses computed on the CPU once the cache is full, 0..1 "
            "(env MOECHAT_MOE_CACHE_CPU_SHARE)",
        )
        p.add_argument(
            "--moe-cache-trace",
            default=None,
            metavar="PATH",
            help="write every expert lookup to PATH (env MOECHAT_MOE_CACHE_TRACE)",
        )
    p.add_argument(
        "--load-mode",
        choices=("mmap", "pinned"),
        default=os.environ.get("MOECHAT_LOAD_MODE", "mmap"),
        help="CUDA: keep the host experts memory-mapped (fast start) or copy them to pinned memory "
        "(uploads at full link speed, slower start, locked RAM)",
    )
    p.add_argument(
        "--cpu-dequant-mib",
        type=float,
        default=None,
        metavar="N",
        help="with --cpu-kernels exact: keep up to N MiB of dequantized experts (0 = off)",
    )
    p.add_argument(
        "--cpu-kernels",
        choices=tuple(KERNEL_MODES),
        default=None,
        help="CPU matmuls. " + describe_kernel_modes(),
    )
    p.add_argument(
        "--emulate-link-gbps",
        type=float,
        default=None,
        metavar="X",
        help="CPU device: make each upload also cost bytes / X GB/s, like a PCIe link",
    )
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads for the engine (default 0: one per core; env MOECHAT_THREADS)")  # fmt: skip


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs, each value from flag > MOECHAT_* env > config.toml > default (the
    built-in demo's own defaults where no model is named)."""

    cache: CacheSettings
    cpu_dequant_mib: float
    cpu_kernels: str
    threads: int


def cache_settings(layered: Settings, trace: Path | None = None, load_mode: str = "mmap") -> CacheSettings:
    """The expert cache's settings from resolved settings, checked; errors name the device's source."""
    from moechat.engine.expert_cache import CacheSettings
    from moechat.engine.loader import resolve_device

    try:
        device = resolve_device(layered.device)
    except ValueError as e:
        raise ValueError(f"device from {layered.source('device')}: {e}") from None
    settings = CacheSettings(
        mib=layered.moe_cache_mib, cpu_share=layered.moe_cache_cpu_share, device=device,
        emulate_link_gbps=layered.emulate_link_gbps, trace=trace, load_mode=load_mode,
    )  # fmt: skip
    settings.validate()
    return settings


def layered_settings(args: argparse.Namespace) -> EngineOptions:
    from .paths import app_paths

    names = ("device", "moe_cache_mib", "moe_cache_cpu_share", "emulate_link_gbps", "cpu_dequant_mib", "cpu_kernels",
             "threads")  # fmt: skip
    layered, warnings = resolve(
        {n: getattr(args, n, None) for n in names}, config_path=app_paths().config / "config.toml"
    )
    for w in warnings:
        print(f"moechat: warning: {w}", file=sys.stderr)
    layered = for_demo(layered, getattr(args, "model", None))
    trace = getattr(args, "moe_cache_trace", None) or os.environ.get("MOECHAT_MOE_CACHE_TRACE")
    settings = cache_settings(layered, trace=Path(trace) if trace else None, load_mode=args.load_mode)
    return EngineOptions(settings, layered.cpu_dequant_mib, layered.cpu_kernels, layered.threads)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("-p", "--prompt", required=True, help="the prompt")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--temp", type=float, default=None, help="temperature; 0 = greedy (default 0.8; a demo's own)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=None, help="default 1 (off; a demo's own)")
    p.add_argument("--seed", type=int, default=None, help="same seed, same tokens")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template overriding the GGUF's")
    add_cache_arguments(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None, help="prompt as one user turn")
    mode.add_argument("--raw", dest="chat", action="store_false", help="prompt as given (BOS per the model)")


def run(args: argparse.Namespace) -> int:
    from moechat.engine.generate import DoneEvent, SamplingParams, TokenEvent, generate
    from moechat.engine.loader import load_model, set_threads

    demo = DEMO_DEFAULTS.get(demo_name(args.model) or "", {})  # a demo's sampling, unless the flags say
    params = SamplingParams(
        temperature=args.temp if args.temp is not None else demo.get("temp", 0.8), top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        repeat_penalty=args.repeat_penalty if args.repeat_penalty is not None else demo.get("repeat_penalty", 1.0),
    )  # fmt: skip
    params.validate()
    if args.n_predict < 0:
        raise ValueError(f"-n/--n-predict must be >= 0, got {args.n_predict}")
    from .demo_model import resolve_model

    opts = layered_settings(args)
    set_threads(opts.threads)
    lm = load_model(
        resolve_model(args.model),
        n_ctx=args.ctx_size,
        chat_template=args.chat_template,
        cache=opts.cache,
        cpu_dequant_mib=opts.cpu_dequant_mib,
        cpu_kernels=opts.cpu_kernels,
    )
    chat = args.chat if args.chat is not None else lm.template.origin != "plain fallback"
    prompt = lm.chat_prompt(args.prompt) if chat else lm.tokenizer.encode(args.prompt)
    stop = threading.Event()
    out = sys.stdout
    try:
        for ev in generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=args.n_predict,
                           params=params, ignore_eos=args.ignore_eos, stop=stop):  # fmt: skip
            if isinstance(ev, TokenEvent):
                out.write(ev.text)
                out.flush()
            elif isinstance(ev, DoneEvent):
                out.write("\n")
                print(
                    f"prompt: {ev.n_prompt} tokens, {ev.prompt_tps:.1f} t/s | "
                    f"generation: {ev.n_generated} tokens, {ev.gen_tps:.1f} t/s | stop: {ev.stop_reason}",
                    file=sys.stderr,
                )
                if lm.cache is not None:
                    for line in lm.cache.summary_lines():
                        print(line, file=sys.stderr)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as other command-line tools do.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 0
    except KeyboardInterrupt:
        out.write("\n")
        out.flush()
        print("moechat: interrupted", file=sys.stderr)
        return 130
    finally:
        lm.close()
    return 0
