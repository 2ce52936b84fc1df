"""Driving the app in UI tests: build it over an engine, wait for its chat screen, type a prompt.
Waits poll between UI cycles, never sleep a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moechat.app.screens.chat import ChatScreen
from moechat.app.settings import Settings
from moechat.app.tui import MoechatApp
from moechat.widgets.chat_log import ChatInput, Turn
from textual.pilot import Pilot
from textual.widgets import Markdown, Static

from .fake_engine import FakeEngine


async def until(pilot: Pilot[Any], cond: Callable[[], bool], timeout: float = 120.0) -> None:
    """Poll the condition between UI cycles; fail after `timeout` seconds: far longer than any condition
    takes, so that a busy machine (the suite runs on two workers) slows a test down but never fails it."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)


def make_app(tmp_path: Path, engine: FakeEngine, settings: Settings | None = None) -> MoechatApp:
    from moechat.app.paths import AppPaths

    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    return MoechatApp(lambda progress: engine, settings or Settings(), paths=paths)


async def ready(pilot: Pilot[int], timeout: float = 120.0) -> ChatScreen:
    app = pilot.app
    # The screen is on the stack before its widgets are: its input having the focus says both.
    # (Asking for the input with query_one then raised when the check ran in between.)
    # The chat screen shows while the engine loads: ready means loaded too.
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and isinstance(app.focused, ChatInput)
                and app.focused.screen is app.screen and getattr(app, "engine", None) is not None, timeout)  # fmt: skip
    return app.screen


async def say(pilot: Pilot[int], screen: ChatScreen, text: str) -> None:
    n = len(screen.conv.messages)
    for ch in text:
        await pilot.press(ch if ch != " " else "space")
    await pilot.press("enter")
    await until(pilot, lambda: len(screen.conv.messages) >= n + 2 and not screen.generating)


WORDS = ["The", " river", " rose", " in", " spring", "."]


def on_screen(widget: Static) -> str:
    """The lines the widget draws in its region (what is cut off is not there)."""
    return " ".join(widget.render_line(y).text.strip() for y in range(widget.size.height))


def drawn(widget: Static) -> str:
    """The text a Static draws (its content is what it was given, before any markup is read)."""
    return str(widget.visual)


def reply_markdown(screen: ChatScreen) -> str:
    return screen.query(Turn).last().query_one(Markdown).source
