"""The moechat Textual app: the chat screen at once, the engine loading in a worker behind it.

The input is usable from the first frame: a message sent during the load waits, shown as queued,
and its reply starts when the engine is ready. The load's progress (the demo's build, each kernel a
first start compiles) shows on the chat screen's info line.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from moechat.app.conversations import Conversation, ConversationStore, now_iso
from moechat.app.engine_api import ChatEngine
from moechat.app.export import SessionStats, session_file, transcript_markdown, write_stats
from moechat.app.paths import AppPaths, app_paths
from moechat.app.screens.chat import ChatScreen
from moechat.app.settings import Settings, error_line, save_config
from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.widgets import Label

logger = logging.getLogger(__name__)

EngineFactory = Callable[[Callable[[str], None]], ChatEngine]


class LoadFailed(Screen[None]):
    """The model did not load: its one-line error stays on screen until a key is pressed (then the app exits)."""

    DEFAULT_CSS = """
    LoadFailed { align: center middle; }
    LoadFailed Label { margin: 1; }
    LoadFailed .error { color: $error; width: 90%; }
    """

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def compose(self) -> ComposeResult:
        yield Label(self.message, id="what", classes="error", markup=False)
        yield Label("press any key to quit", id="hint")

    def on_key(self) -> None:
        self.app.exit(2, return_code=2)


class MoechatApp(App[int]):
    TITLE = "moechat"

    def __init__(self, factory: EngineFactory, settings: Settings, *, paths: AppPaths | None = None,
                 config_path: Path | None = None, warnings: Iterable[str] = (),
                 attached: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.attached = attached
        self.factory = factory
        self._settings = settings
        self.paths = paths or app_paths()
        self.config_path = config_path or self.paths.config / "config.toml"
        self.startup_warnings = list(warnings)
        self.engine: ChatEngine = None  # type: ignore[assignment,unused-ignore]  # set once loaded
        self.chat = ChatScreen()  # shown from the start: the input works while the engine loads
        self.engine_lock = threading.Lock()  # one engine job at a time (a reply, a sweep, a cache change)
        self.store = ConversationStore(self.paths.data / "conversations")
        self.session: SessionStats = SessionStats({}, {})
        self.session_file = session_file(self.paths.data)
        self.exit_code = 0
        self.failure: str | None = None  # why the model did not load; printed on stderr after exit too
        # (MiB, CPU share) of the engine's cache, asked once at load and kept as the wizard changes it:
        # the UI never waits on the engine for it (a streaming reply holds the engine's pipe).
        self.cache_in_effect = (0.0, 0.0)

    def on_mount(self) -> None:
        if self.settings.theme in self.available_themes:
            self.theme = self.settings.theme
        for w in self.startup_warnings:
            self.notify(w, severity="warning", timeout=10)
        self.push_screen(self.chat)
        self.load_engine()

    @work(thread=True, exclusive=True, group="load")
    def load_engine(self) -> None:
        def progress(text: str) -> None:
            self.call_from_thread(self._loading_text, text)

        try:
            engine = self.factory(progress)
        except Exception as e:  # a bad file: one line, then exit 2
            self.call_from_thread(self._failed, error_line(e))
            return
        self.call_from_thread(self._engine_ready, engine)

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True) -> None:  # fmt: skip
        # Notifications carry errors, file paths and strings from model files: plain text always,
        # never markup ("[/x]" would raise, "[@click=...]" would act). Widgets' notify() lands
        # here too, with markup=True by default, so the argument is overridden, not defaulted.
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=False)

    def _loading_text(self, text: str) -> None:
        self.chat.show_loading(text)

    def _failed(self, message: str) -> None:
        self.failure = f"moechat: error: {message}"
        logger.error("%s", self.failure)
        if self.chat.conv.messages:  # a message sent during the load is kept
            self.save_conversation(self.chat.conv)
        self.push_screen(LoadFailed(self.failure))

    def _engine_ready(self, engine: ChatEngine) -> None:
        self.engine = engine
        self.cache_in_effect = engine.cache()
        self.session = SessionStats(asdict(engine.info), self.settings_dict())
        self.chat.engine_ready()

    @property
    def settings(self) -> Settings:
        return self._settings

    @settings.setter
    def settings(self, value: Settings) -> None:
        # Every change (the settings dialog, the wizard, the theme) reaches the session's export.
        self._settings = value
        if self.session.model:
            self.session.settings = self.settings_dict()

    def settings_dict(self) -> dict[str, Any]:
        d = self.settings.values()
        if self.engine is not None:
            d["moe_cache_mib"], d["moe_cache_cpu_share"] = self.cache_in_effect
        return d

    def apply_cache_settings(self, mib: float, share: float) -> None:
        """The engine's cache now runs at (mib, share): the settings and the session follow."""
        self.session.cache_rebuilt()
        self.cache_in_effect = (mib, share)
        self.settings = replace(self.settings, moe_cache_mib=mib, moe_cache_cpu_share=share)

    # -- persistence --------------------------------------------------------------------------

    def save_conversation(self, conv: Conversation) -> None:
        try:
            self.store.save(conv)
        except OSError as e:
            self.notify(f"could not save the conversation: {e}", severity="error", timeout=10)

    def save_session(self) -> None:
        try:
            write_stats(self.session.to_dict(), self.session_file, "json")
        except OSError as e:
            self.notify(f"could not save the session stats: {e}", severity="error")

    def refresh_snapshot(self) -> None:
        """The engine's counters as they are now, when it is idle: the slots held, the share and the warm
        start of the cache in use, which the dashboard shows, also after a cache change that no reply has
        streamed since (a reply streams its own snapshots; during one the latest of them is kept)."""
        if self.engine is None or not self.engine_lock.acquire(blocking=False):
            return
        try:
            snap = self.engine.snapshot()
        except Exception as e:  # the export still goes out, with the last streamed counters
            logger.warning("no fresh snapshot for the export: %s", e)
            return
        finally:
            self.engine_lock.release()
        if snap is not None:
            self.session.snapshot = snap

    def export_all(self, folder: Path | None = None) -> list[Path]:
        """Session stats as JSON, CSV and Markdown, and the chat as Markdown, into the exports folder."""
        folder = folder or self.paths.data / "exports"
        stamp = now_iso().replace(":", "")
        self.refresh_snapshot()
        d = self.session.to_dict()
        written = []
        try:
            for fmt, ext in (("json", "json"), ("csv", "csv"), ("md", "md")):
                written += write_stats(d, folder / f"stats-{stamp}.{ext}", fmt)
            from moechat.app.atomic import write_atomic

            if isinstance(self.screen, ChatScreen):
                written.append(write_atomic(folder / f"chat-{stamp}.md", transcript_markdown(self.screen.conv)))
        except OSError as e:
            self.notify(f"export failed: {e}; earlier files are intact", severity="error", timeout=10)
            return written
        self.notify(f"exported to {folder}: " + ", ".join(p.name for p in written))
        return written

    def watch_theme(self, theme: str) -> None:
        # The theme is remembered in config.toml (best effort: a read-only config dir is not an error).
        if self.engine is None or theme == self.settings.theme:
            return
        self.settings = replace(self.settings, theme=theme)
        try:
            save_config(self.config_path, {"theme": theme})
        except (OSError, ValueError) as e:
            logger.warning("theme not saved: %s", e)

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)

        if isinstance(screen, ChatScreen):
            for title, help_text, action in (
                ("Stop reply", "stop the reply being written (Esc)", screen.action_stop),
                ("Regenerate", "write the last reply again (Ctrl+R)", screen.action_regenerate),
                ("New chat", "start an empty conversation (Ctrl+N)", screen.action_new_chat),
                ("Open chat", "reopen a saved conversation (Ctrl+O)", screen.action_open_chat),
                ("Settings", "system prompt and sampling (Ctrl+S)", screen.action_settings),
                ("Tune cache", "run the tuning wizard (Ctrl+T)", screen.action_tune),
                ("Export", "stats as JSON, CSV, Markdown and the chat as Markdown (Ctrl+E)", screen.action_export),
                ("Toggle dashboard", "show or hide the cache dashboard (Ctrl+B)", screen.action_toggle_dashboard),
                ("Earlier messages", "bring back earlier turns of a long chat (or scroll up)", screen.show_earlier),
            ):
                yield SystemCommand(title, help_text, action)

    def on_unmount(self) -> None:
        gc.unfreeze()  # the chat screen froze the heap for the app's lifetime; it ends here
        if self.engine is not None:
            self.engine.close()


def real_engine_factory(model: str | None, settings: Settings, warm_dir: Path | None = None) -> EngineFactory:
    """The engine for the app: the model in a child process (see engine_process.py).

    `warm_dir`: where the expert cache keeps each model's use counts between runs (warm start)."""

    def build(progress: Callable[[str], None]) -> ChatEngine:
        from moechat.app.engine_process import EngineSpec, ProcessEngine

        return ProcessEngine(EngineSpec(model, settings, str(warm_dir) if warm_dir else None), progress)

    return build


def _terminated(app: MoechatApp) -> None:
    """SIGTERM (a system shutting down; torchrun stopping every rank of a split when one has ended): the
    app closes as on quit (the terminal restored, the engine closed) and says why."""
    app.failure = app.failure or (
        "moechat: error: stopped by SIGTERM" + (" (a rank of the split ended; torchrun stopped the others)"
                                              if os.environ.get("TORCHELASTIC_RUN_ID") else ""))  # fmt: skip
    app.exit(return_code=2)


def run_tui(app: MoechatApp, log_path: Path) -> int:
    """Run the app with native stderr (torch, CUDA) going to the log file, never onto the screen.

    Textual draws on `sys.__stderr__`: it gets a private duplicate of the terminal, and fd 2,
    where C++ code writes, goes to the log file.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    saved = os.dup(2)
    terminal = os.fdopen(os.dup(2), "w", encoding="utf-8", errors="replace")
    original = sys.__stderr__
    with open(log_path, "a") as log:
        handler = logging.StreamHandler(log)
        logging.getLogger().addHandler(handler)
        sys.__stderr__ = terminal  # type: ignore[misc]  # what Textual draws on
        os.dup2(log.fileno(), 2)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: _terminated(app))
        try:
            code = app.run()
        finally:
            signal.signal(signal.SIGTERM, previous)
            os.dup2(saved, 2)
            os.close(saved)
            sys.__stderr__ = original  # type: ignore[misc]
            terminal.close()
            logging.getLogger().removeHandler(handler)
    if app.failure is not None:
        print(app.failure, file=sys.stderr)  # the terminal is restored: the error stays visible
        return 2
    if isinstance(code, int):
        return code
    return app.return_code or 0
