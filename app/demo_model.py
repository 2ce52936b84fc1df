"""The model to open: the user's file, or a built-in demo (built once, with a progress bar)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from moechat.app.paths import app_paths
from moechat.app.settings import demo_name
from moechat.demo.build import DemoError, demo_path, ensure_demo
from moechat.demo.source import DemoSourceMissing
from rich.console import Console
from rich.progress import Progress


def resolve_model(model: str | None) -> Path:
    """The model path; a demo is built on first use with a progress bar on stderr."""

    def build(cache: Path, name: str) -> Path:
        with Progress(transient=True, console=Console(file=sys.stderr)) as bar:
            task = bar.add_task("building the demo model (first use only)", total=1.0)
            return ensure_demo(cache, lambda done, what: bar.update(task, completed=done, description=what), name)

    return _resolve(model, build)


def resolve_model_quiet(model: str | None, progress: Callable[[str], None]) -> Path:
    """resolve_model for the TUI: progress goes to a callback, not to stderr."""

    def build(cache: Path, name: str) -> Path:
        return ensure_demo(cache, lambda done, what: progress(f"building the demo model: {what} ({100 * done:.0f}%)"),
                           name)  # fmt: skip

    return _resolve(model, build)


def _resolve(model: str | None, build: Callable[[Path, str], Path]) -> Path:
    name = demo_name(model)
    if name is None:
        return Path(str(model))
    cache = app_paths().cache
    try:
        target = demo_path(cache, name)
        return target if target.exists() else build(cache, name)
    except (DemoSourceMissing, DemoError) as e:
        raise ValueError(f"{e}; or pass a model path") from None
