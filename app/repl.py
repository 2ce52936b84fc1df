"""`moechat chat` (and `moechat` alone): the full-screen app on a terminal, else a plain line-mode chat.

Each turn renders the whole conversation through the chat template and streams the reply.
Ctrl+C stops a reply (the partial reply is kept), Ctrl+D or an empty stdin ends the chat.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from moechat.app.run_cmd import StatusLine, add_config_flag
from moechat.app.settings import (
    APP,
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

if TYPE_CHECKING:  # the engine (torch) loads when a chat starts, not for --help
    from moechat.app.real_engine import RealEngine
    from moechat.engine.events import DoneEvent, SamplingParams

SETTINGS = (*SAMPLING, *ENGINE, *APP)


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """Every setting as a flag; one left out comes from MOECHAT_* env, then config.toml, then its default."""
    p.add_argument("model", nargs="?", help=MODEL_HELP)
    p.add_argument("--plain", action="store_true", help="line-mode chat instead of the full-screen app")
    add_flags(p, SETTINGS)
    add_config_flag(p)


def run_chat(args: argparse.Namespace) -> int:
    """The chat. Started by torchrun as a rank of a model split over hosts (engine/distributed), rank 0
    chats as one process would, its engine reaching every stage; the other ranks serve their layers."""
    from moechat.engine.distributed import launched

    settings, warnings, config = from_args(args, SETTINGS)
    try:
        check_model_file(args.model)  # a bad file fails before the app (or the engine) starts
    except (ValueError, OSError):
        print_warnings(warnings)
        raise
    ranks = launched()
    if ranks is not None and ranks[0] != 0:
        from moechat.app.paths import app_paths
        from moechat.app.split_run import run_as_rank

        print_warnings(warnings)
        return run_as_rank(args.model, settings, None, app_paths().data / "warm")
    if not args.plain and sys.stdin.isatty() and sys.stdout.isatty():
        from moechat.app.paths import app_paths
        from moechat.app.tui import MoechatApp, real_engine_factory, run_tui

        warm_dir = app_paths().data / "warm"  # each model's expert use counts, for the next start
        app = MoechatApp(real_engine_factory(args.model, settings, warm_dir), settings,
                         config_path=config, warnings=warnings)  # fmt: skip
        return run_tui(app, app_paths().log / "moechat.log")
    print_warnings(warnings)
    return _line_chat(args, settings)


def _line_chat(args: argparse.Namespace, settings: Settings) -> int:
    """Line mode, a full citizen: the engine in this process (the app's prompt fitting and stop strings),
    and, as the app does, the conversation and the session's stats saved after each reply and the
    expert cache warm-started from, and saved to, this model's use counts. `-v` prints each
    reply's stats as `moechat run` does."""
    from moechat.app.demo_model import resolve_model
    from moechat.app.paths import app_paths
    from moechat.app.real_engine import RealEngine, load_for
    from moechat.app.tuned import identity_of
    from moechat.engine.distributed import launched

    sampling_params(settings)  # bad values fail before the model loads
    warm_dir = app_paths().data / "warm"
    if launched() is not None:  # rank 0 of a split
        from moechat.app.split_run import run_as_rank

        return run_as_rank(args.model, settings, lambda pm, lm, identity, cache: _chat_lines(
            args, settings, RealEngine(lm, replace(cache, mib=0.0, cpu_share=0.0, trace=None), identity, pm)),
            warm_dir)  # fmt: skip
    path = resolve_model(args.model)
    identity = identity_of(path)
    cache = cache_settings(settings, warm_dir / f"{identity}.json" if identity else None)
    status = StatusLine()
    lm = load_for(path, settings, cache, status, first_start=True)
    status.done()
    return _chat_lines(args, settings, RealEngine(lm, replace(cache, mib=0.0, cpu_share=0.0, trace=None), identity))


def _chat_lines(args: argparse.Namespace, settings: Settings, engine: RealEngine) -> int:
    """The line-mode chat's turns, until the end of stdin; `engine` is closed at the end."""
    from moechat.app.conversations import Conversation, ConversationStore
    from moechat.app.export import SessionStats, reply_record, reply_stats, session_file, write_stats
    from moechat.app.paths import app_paths
    from moechat.engine.cache.stats import summary_lines

    params = sampling_params(settings)
    paths = app_paths()
    lm = engine.lm
    settings_now = settings.values()
    conv = Conversation(model=engine.info.name, system=settings.system)
    store = ConversationStore(paths.data / "conversations")
    session = SessionStats(asdict(engine.info), settings_now)
    stats_file = session_file(paths.data)
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
            conv.messages.append({"role": "user", "content": line})
            prompt, dropped, note = engine.fit_messages(conv.chat_messages())
            if note:
                print(f"moechat: warning: {note}", file=sys.stderr)
            if dropped:
                print(f"moechat: the {dropped} oldest messages no longer fit the context and are left out",
                      file=sys.stderr)  # fmt: skip
            text, done = _reply(engine, prompt, settings.n_predict, params)
            stats = reply_stats(done)
            conv.messages.append({"role": "assistant", "content": text, "stopped": done.stop_reason == "stopped",
                                  "stats": stats})  # fmt: skip
            snapshot = engine.snapshot()
            session.add(snapshot, done.n_generated, done.gen_tps)
            session.replies.append(reply_record(stats, done.stop_reason, settings_now))
            _save(lambda: store.save(conv), "the conversation")
            _save(lambda: write_stats(session.to_dict(), stats_file, "json"), "the session stats")
            if getattr(args, "verbose", False):
                print(f"prompt: {done.n_prompt} tokens read ({done.n_kept} kept), {done.prompt_tps:.1f} t/s | "
                      f"generation: {done.n_generated} tokens, {done.gen_tps:.1f} t/s | stop: {done.stop_reason}",
                      file=sys.stderr)  # fmt: skip
                for text_line in summary_lines(snapshot) if snapshot is not None else ():
                    print(text_line, file=sys.stderr)
    finally:
        engine.close()  # the expert cache writes this model's use counts (the next start's warm start)
    return 0


def _save(write: Callable[[], object], what: str) -> None:
    try:
        write()
    except OSError as e:
        print(f"moechat: warning: could not save {what}: {e}", file=sys.stderr)


def _reply(engine: RealEngine, prompt: list[int], n: int, params: SamplingParams) -> tuple[str, DoneEvent]:
    from moechat.engine.events import DoneEvent, TokenEvent

    stop = threading.Event()
    text = ""
    done = DoneEvent(len(prompt), 0, 0.0, 0.0, "stopped")
    try:
        for ev in engine.reply(prompt, params, n, stop):
            if isinstance(ev, TokenEvent) and ev.text:
                text += ev.text
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, DoneEvent):
                done = ev
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return text.strip(), done
