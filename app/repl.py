"""`moechat chat` (and `moechat` alone): the full-screen app on a terminal, else a plain line-mode chat.

Each turn renders the whole conversation through the chat template and streams the reply.
Ctrl+C stops a reply (the partial reply is kept), Ctrl+D or an empty stdin ends the chat.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from moechat.engine.kernel_modes import KERNEL_MODES
from moechat.engine.kernel_modes import describe as describe_kernel_modes

from .run_cmd import cache_settings
from .settings import MODEL_HELP, SPEC, Settings, for_demo, resolve

if TYPE_CHECKING:  # the engine (torch) loads when a chat starts, not for --help
    from moechat.engine.generate import SamplingParams

    from .engine_api import RealEngine


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """Chat flags default to None: a value left out comes from MOECHAT_* env, then config.toml, then defaults."""
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("-n", "--n-predict", type=int, default=None, help="most tokens per reply (default 512)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (default 4096)")
    p.add_argument("--temp", type=float, default=None, help="temperature (default 0.7)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repeat-penalty", type=float, default=None, help="penalty on the last 64 tokens (default 1: off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--chat-template", default=None, metavar="FILE")
    p.add_argument("--device", default=None, help="auto, cuda or cpu")
    p.add_argument("--moe-cache-mib", type=float, default=None, metavar="N", help="device expert cache in MiB; 0 = off")
    p.add_argument("--moe-cache-cpu-share", type=float, default=None, metavar="F",
                   help="share of the misses computed on the CPU once the cache is full, 0..1")  # fmt: skip
    p.add_argument("--emulate-link-gbps", type=float, default=None, metavar="X",
                   help="CPU device: uploads also cost bytes / X GB/s")  # fmt: skip
    p.add_argument("--cpu-dequant-mib", type=float, default=None, metavar="N",
                   help="with --cpu-kernels exact: keep up to N MiB of dequantized experts (0 = off)")  # fmt: skip
    p.add_argument("--cpu-kernels", choices=tuple(KERNEL_MODES), default=None,
                   help="CPU matmuls. " + describe_kernel_modes())  # fmt: skip
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N",
                   help="CPU threads for the engine (default 0: one per core)")  # fmt: skip
    p.add_argument("--refresh-ms", type=int, default=None, help="dashboard refresh interval (default 250)")
    p.add_argument("--theme", default=None, help="Textual theme (remembered in config.toml)")
    p.add_argument("--config", default=None, metavar="PATH", help="config.toml to read (default: the config dir)")
    p.add_argument("--plain", action="store_true", help="line-mode chat instead of the full-screen app")


def chat_settings(args: argparse.Namespace) -> tuple[Settings, list[str], Path]:
    from .paths import app_paths

    config = Path(args.config) if args.config else app_paths().config / "config.toml"
    if args.config and not config.is_file():
        raise ValueError(f"--config {config}: no such file")
    flags = {name: getattr(args, name, None) for name in SPEC}
    settings, warnings = resolve(flags, config_path=config)
    return settings, warnings, config


def run_chat(args: argparse.Namespace) -> int:
    from moechat.engine.generate import SamplingParams
    from moechat.engine.loader import ContextTooLarge, load_model, set_threads

    from .demo_model import resolve_model

    settings, warnings, config = chat_settings(args)
    settings = for_demo(settings, args.model)
    if not args.plain and sys.stdin.isatty() and sys.stdout.isatty():
        from .paths import app_paths
        from .tui import MoechatApp, real_engine_factory, run_tui

        warm_dir = app_paths().data / "warm"  # each model's expert use counts, for the next start
        app = MoechatApp(real_engine_factory(args.model, settings, args.chat_template, warm_dir), settings,
                         config_path=config, warnings=warnings)  # fmt: skip
        return run_tui(app, app_paths().log / "moechat.log")
    for w in warnings:
        print(f"moechat: warning: {w}", file=sys.stderr)
    params = SamplingParams(temperature=settings.temp, top_k=settings.top_k, top_p=settings.top_p,
                            min_p=settings.min_p, repeat_penalty=settings.repeat_penalty, seed=args.seed)  # fmt: skip
    params.validate()
    cache = cache_settings(settings)
    set_threads(settings.threads)
    try:
        lm = load_model(resolve_model(args.model), n_ctx=settings.ctx_size, chat_template=args.chat_template,
                        cache=cache, cpu_dequant_mib=settings.cpu_dequant_mib,
                        cpu_kernels=settings.cpu_kernels)  # fmt: skip
    except ContextTooLarge as e:
        raise ValueError(f"ctx_size from {settings.source('ctx_size')}: {e}") from None
    from .engine_api import RealEngine

    # The app's engine in this process: the same prompt fitting (oldest turns dropped when the
    # context is full, the plain format when the template fails) and the same stop strings.
    engine = RealEngine(lm, cache)
    messages: list[dict[str, str]] = [{"role": "system", "content": settings.system}] if settings.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"moechat: {lm.config.name} ({lm.config.arch}). Ctrl+C stops a reply, Ctrl+D quits.", file=sys.stderr)
    try:
        while True:
            try:
                line = input("you> " if interactive else "")
            except EOFError:
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            prompt, dropped, note = engine.fit_messages(messages)
            if note:
                print(f"moechat: warning: {note}", file=sys.stderr)
            if dropped:
                print(f"moechat: the {dropped} oldest messages no longer fit the context and are left out",
                      file=sys.stderr)  # fmt: skip
            messages.append({"role": "assistant", "content": _reply(engine, prompt, settings.n_predict, params)})
    finally:
        lm.close()
    return 0


def _reply(engine: RealEngine, prompt: list[int], n: int, params: SamplingParams) -> str:
    from moechat.engine.generate import TokenEvent

    stop = threading.Event()
    text = ""
    try:
        for ev in engine.reply(prompt, params, n, stop):
            if isinstance(ev, TokenEvent) and ev.text:
                text += ev.text
                sys.stdout.write(ev.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return text.strip()
