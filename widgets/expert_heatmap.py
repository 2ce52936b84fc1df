"""Layer x expert heat map of use, cached experts marked."""

from __future__ import annotations

import math
from itertools import groupby
from operator import itemgetter

from moechat.engine.stats import StatsSnapshot
from rich.text import Text
from textual.widgets import Static

from .redraw import Throttle, update_fixed

SHADES = " .:-=+*#%@"
MAX_COLUMNS = 64  # wider layers are folded: a column then shows the busiest of its experts
REDRAW_EVERY = 1.0  # seconds: use counts move slowly, and this map is the dashboard's costliest text
CACHED = "reverse cyan"


def heat_rows(snap: StatsSnapshot, max_columns: int = MAX_COLUMNS) -> list[Text]:
    rows = []
    peak = max((max(ls.use_counts, default=0) for ls in snap.layers), default=0)
    scale = (len(SHADES) - 2) / math.log1p(peak) if peak else 0.0
    for ls in snap.layers:
        n = len(ls.use_counts)
        fold = max(1, math.ceil(n / max_columns))
        cached = set(ls.cached)
        line = Text(f"{ls.layer:>3} ")
        cells = []
        for start in range(0, n, fold):
            span = range(start, min(n, start + fold))
            use = max(ls.use_counts[e] for e in span)
            level = 0 if use == 0 else 1 + int(scale * math.log1p(use))
            char = SHADES[min(level, len(SHADES) - 1)]
            # Cached experts stand out in reverse video: visible in 16 colours and in monochrome.
            cells.append((char if char != " " else "·", not cached.isdisjoint(span)))
        # Characters of one style go in one span: far cheaper to draw than a span each.
        for is_cached, run in groupby(cells, key=itemgetter(1)):
            line.append("".join(c for c, _ in run), style=CACHED if is_cached else "")
        rows.append(line)
    return rows


class ExpertHeatmap(Static):
    DEFAULT_CSS = "ExpertHeatmap { height: auto; }"

    def __init__(self, **kw: object) -> None:
        super().__init__("", **kw)  # type: ignore[arg-type]
        self.snapshot: StatsSnapshot | None = None
        self._redraw = Throttle(REDRAW_EVERY)

    def show(self, snap: StatsSnapshot, *, final: bool = False) -> None:
        """Keep the snapshot; redraw at most once a second, and always for the final one."""
        self.snapshot = snap
        if self._redraw.due(force=final):
            update_fixed(self, Text("\n").join(heat_rows(snap)), max(1, len(snap.layers)))
