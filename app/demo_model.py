"""The model to open: the user's file, or the built-in demo (built once, with a progress bar)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from moechat.engine.demo import demo_path, ensure_demo
from moechat.engine.demo_source import DemoSourceMissing
from rich.console import Console
from rich.progress import Progress

from .paths import app_paths


def resolve_model(model: str | None) -> Path:
    """The model path; the demo is built on first use with a progress bar on stderr."""

    def build(cache: Path) -> Path:
        with Progress(transient=True, console=Console(file=sys.stderr)) as bar:
            task = bar.add_task("building the demo model (first use only)", total=1.0)
            return ensure_demo(cache, lambda done, what: bar.update(task, completed=done, description=what))

    return _resolve(model, build)


def resolve_model_quiet(model: str | None, progress: Callable[[str], None]) -> Path:
    """resolve_model for the TUI: progress goes to a callback, not to stderr."""
    return _resolve(
        model, lambda cache: ensure_demo(cache, lambda done, what: progress(f"building the demo model: {what} "
                                                                             f"({100 * done:.0f}%)"))
    )  # fmt: skip


def _resolve(model: str | None, build: Callable[[Path], Path]) -> Path:
    if model:
        return Path(model)
    cache = app_paths().cache
    try:
        target = demo_path(cache)
        return target if target.exists() else build(cache)
    except DemoSourceMissing as e:
        raise ValueError(f"{e}, or pass a model path") from None
