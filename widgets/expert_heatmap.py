"""Layer x expert heat map of use, cached experts marked."""

from __future__ import annotations

import math
from itertools import groupby
from operator import itemgetter

from moechat.engine.stats import StatsSnapshot

from .redraw import Throttle
from .rows import Row, RowsView

SHADES = " .:-=+*#%@"
MAX_COLUMNS = 64  # wider layers are folded: a column then shows the busiest of its experts
REDRAW_EVERY = 1.0  # seconds: use counts move slowly
CACHED = "reverse cyan"


def heat_rows(snap: StatsSnapshot, max_columns: int = MAX_COLUMNS) -> list[Row]:
    rows = []
    peak = max((max(ls.use_counts, default=0) for ls in snap.layers), default=0)
    scale = (len(SHADES) - 2) / math.log1p(peak) if peak else 0.0
    for ls in snap.layers:
        n = len(ls.use_counts)
        fold = max(1, math.ceil(n / max_columns))
        cached = set(ls.cached)
        cells = []
        for start in range(0, n, fold):
            span = range(start, min(n, start + fold))
            use = max(ls.use_counts[e] for e in span)
            level = 0 if use == 0 else 1 + int(scale * math.log1p(use))
            char = SHADES[min(level, len(SHADES) - 1)]
            # Cached experts stand out in reverse video: visible in 16 colours and in monochrome.
            cells.append((char if char != " " else "·", not cached.isdisjoint(span)))
        row: Row = [(f"{ls.layer:>3} ", "")]
        # Characters of one style go in one run: one segment each.
        for is_cached, run in groupby(cells, key=itemgetter(1)):
            row.append(("".join(c for c, _ in run), CACHED if is_cached else ""))
        rows.append(row)
    return rows


class ExpertHeatmap(RowsView):
    def __init__(self, **kw: object) -> None:
        super().__init__("", **kw)
        self.snapshot: StatsSnapshot | None = None
        self._redraw = Throttle(REDRAW_EVERY)

    def show(self, snap: StatsSnapshot, *, final: bool = False) -> None:
        """Keep the snapshot; redraw at most once a second, and always for the final one."""
        self.snapshot = snap
        if self._redraw.due(force=final):
            self.set_rows(heat_rows(snap) or [[("", "")]])
