"""Tokens per second over time: one plotext Plot in its own widget."""

from __future__ import annotations

from collections import deque

from textual_plotext import PlotextPlot

POINTS = 300


class ThroughputPlot(PlotextPlot):
    DEFAULT_CSS = "ThroughputPlot { height: 12; }"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.points: deque[tuple[int, float]] = deque(maxlen=POINTS)

    def on_mount(self) -> None:
        self.plt.title("tokens/s")

    def add(self, tokens: int, tps: float) -> None:
        self.points.append((tokens, tps))
        self.plt.clear_data()
        if len(self.points) >= 2:
            self.plt.plot([p[0] for p in self.points], [p[1] for p in self.points], marker="braille")
        self.refresh()
