"""What the dashboard's widgets share to stay cheap to draw: a redraw throttle and fixed heights."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import Static


class Throttle:
    """Says a redraw is due at most once every `every` seconds (the first time, and when forced, always)."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._last: float | None = None

    def due(self, force: bool = False) -> bool:
        now = time.monotonic()
        if force or self._last is None or now - self._last >= self.every:
            self._last = now
            return True
        return False


def update_fixed(widget: Static, content: Text, rows: int) -> None:
    """Show `content` in exactly `rows` lines; the screen relays out only when that height changes.

    A Static's update relays out the whole screen unless its size is known not to change.
    """
    changed = widget.styles.height is None or widget.styles.height.cells != rows
    if changed:
        widget.styles.height = rows
    widget.update(content, layout=changed)
