"""Tokens per second over time: one plotext Plot in its own widget."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from moechat.widgets.ticks import whole_ticks
from textual_plotext import PlotextPlot

POINTS = 300


def thin(points: Sequence[tuple[int, float]], n: int) -> tuple[list[float], list[float]]:
    """At most `n` points: consecutive runs averaged (x and y), so the chart keeps its shape.

    plotext's drawing time grows with the points given (44x12: 26 ms for 300, 5 ms for 10), and a
    chart a few columns wide shows no more detail than one point per column.
    """
    n = max(n, 2)
    if len(points) <= n:
        return [float(p[0]) for p in points], [p[1] for p in points]
    xs, ys = [], []
    for i in range(n):
        run = points[i * len(points) // n : (i + 1) * len(points) // n]
        xs.append(sum(p[0] for p in run) / len(run))
        ys.append(sum(p[1] for p in run) / len(run))
    return xs, ys


class ThroughputPlot(PlotextPlot):
    DEFAULT_CSS = "ThroughputPlot { height: 12; }"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.points: deque[tuple[int, float]] = deque(maxlen=POINTS)
        self.draws = 0  # plots drawn: tests check the publisher keeps them to about one a second

    def on_mount(self) -> None:
        self.plt.title("tokens/s, this reply")
        self.plt.xlabel("tokens of the reply")

    def add(self, tokens: int, tps: float, *, redraw: bool = True) -> None:
        """Record a point; draw when told (plotext drawing is the dashboard's costliest part: the
        publisher asks for it once a second).

        A reply's token count starts again from zero: the chart then shows the new reply only,
        never the earlier ones drawn over it.
        """
        if self.points and tokens < self.points[-1][0]:
            self.points.clear()
        self.points.append((tokens, tps))
        if not redraw:
            return
        self.draws += 1
        self.plt.clear_data()
        if len(self.points) >= 2:
            xs, ys = thin(list(self.points), self.size.width)  # one a column
            self.plt.plot(xs, ys, marker="braille")
            ticks = whole_ticks(xs, most=max(2, self.size.width // 8))
            self.plt.xticks([float(t) for t in ticks], [str(t) for t in ticks])
        self.refresh()
