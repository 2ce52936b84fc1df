"""A redraw throttle: what the dashboard's costlier parts share to stay cheap to draw."""

from __future__ import annotations

import time


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
