"""The one throttle of the statistics' way to the screen."""

from __future__ import annotations

import time
from collections.abc import Callable


class Cadence:
    """When a publisher of snapshots sends: at most once every `every` seconds, and a full update
    (one the costly views redraw for) at most once every `full_every`; the last of a stream always
    goes, full. The one throttle of the snapshots' way to the screen: the engine process and the
    reply worker publish through it, the widgets draw what they are sent."""

    def __init__(
        self, every: float, full_every: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every, self.full_every = every, max(every, full_every or every)
        self._clock = clock
        self._last = self._last_full = -float("inf")

    def due(self, last: bool = False) -> tuple[bool, bool]:
        """(send now, and whether it is a full update)."""
        now = self._clock()
        if not last and now - self._last < self.every:
            return False, False
        self._last = now
        full = last or now - self._last_full >= self.full_every
        if full:
            self._last_full = now
        return True, full
