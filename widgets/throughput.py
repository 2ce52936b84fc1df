"""Tokens per second over time: one plotext Plot in its own widget."""

from __future__ import annotations

from collections import deque

from textual_plotext import PlotextPlot

from .redraw import Throttle

POINTS = 300
REDRAW_EVERY = 1.0  # seconds


class ThroughputPlot(PlotextPlot):
    DEFAULT_CSS = "ThroughputPlot { height: 12; }"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.points: deque[tuple[int, float]] = deque(maxlen=POINTS)
        self._redraw = Throttle(REDRAW_EVERY)

    def on_mount(self) -> None:
        self.plt.title("tokens/s")

    def add(self, tokens: int, tps: float, *, final: bool = False) -> None:
        """Record a point; redraw at most once a second (plotext drawing is the dashboard's costliest part)."""
        self.points.append((tokens, tps))
        if not self._redraw.due(force=final):
            return
        self.plt.clear_data()
        if len(self.points) >= 2:
            self.plt.plot([p[0] for p in self.points], [p[1] for p in self.points], marker="braille")
        self.refresh()
