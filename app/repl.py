"""`moechat chat` (and `moechat` alone): the full-screen app on a terminal, else a plain line-mode chat.

Each turn renders the whole conversation through the chat template and streams the reply.
Ctrl+C stops a reply (the partial reply is kept), Ctrl+D or an empty stdin ends the chat.
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import TYPE_CHECKING

from moechat.app.run_cmd import add_config_flag
from moechat.app.settings import (
    APP,
    ENGINE,
    MODEL_HELP,
    SAMPLING,
    add_flags,
    cache_settings,
    from_args,
    print_warnings,
    sampling_params,
)

if TYPE_CHECKING:  # the engine (torch) loads when a chat starts, not for --help
    from moechat.app.real_engine import RealEngine
    from moechat.engine.events import SamplingParams

SETTINGS = (*SAMPLING, *ENGINE, *APP)


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """Every setting as a flag; one left out comes from MOECHAT_* env, then config.toml, then its default."""
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--plain", action="store_true", help="line-mode chat instead of the full-screen app")
    add_flags(p, SETTINGS)
    add_config_flag(p)


def run_chat(args: argparse.Namespace) -> int:
    settings, warnings, config = from_args(args, SETTINGS)
    if not args.plain and sys.stdin.isatty() and sys.stdout.isatty():
        from moechat.app.paths import app_paths
        from moechat.app.tui import MoechatApp, real_engine_factory, run_tui

        warm_dir = app_paths().data / "warm"  # each model's expert use counts, for the next start
        app = MoechatApp(real_engine_factory(args.model, settings, warm_dir), settings,
                         config_path=config, warnings=warnings)  # fmt: skip
        return run_tui(app, app_paths().log / "moechat.log")
    # Line mode: the engine runs in this process (the app's UI process never loads torch or numba).
    from moechat.app.demo_model import resolve_model
    from moechat.app.real_engine import load_for

    print_warnings(warnings)
    params = sampling_params(settings)
    cache = cache_settings(settings)
    lm = load_for(resolve_model(args.model), settings, cache)
    from moechat.app.real_engine import RealEngine

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
    from moechat.engine.events import TokenEvent

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
