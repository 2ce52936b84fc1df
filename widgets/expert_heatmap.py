"""Layer x expert heat map of use, cached experts marked."""

from __future__ import annotations

import math
from itertools import groupby
from operator import itemgetter

from moechat.engine.cache.stats import StatsSnapshot
from moechat.widgets.layer_stats import fold_layers
from moechat.widgets.rows import Row, RowsView
from rich.text import Text

SHADES = " .:-=+*#%@"
MAX_COLUMNS = 64  # wider layers are folded: a column then shows the busiest of its experts
CACHED = "reverse cyan"


TICK_EVERY = 16  # columns between two numbers of the expert axis


def legend() -> Text:
    """The map's title and what its characters mean, in one line of the panel: the shades from unused to
    most used (log scale), and the cached mark."""
    return Text.assemble(("experts", "bold"), " · unused ", SHADES[1:], " more ", ("e", CACHED), " cached")


def axis(snap: StatsSnapshot, max_columns: int = MAX_COLUMNS, fold_rows: int = 1) -> str:
    """The line above the map: "L" over the layer labels, and over the columns the expert each numbered
    column starts at (a folded column holds several experts), aligned with `heat_rows`."""
    if not snap.layers:
        return ""
    n = len(snap.layers[0].use_counts)
    fold = max(1, math.ceil(n / max_columns))
    width = max(3, max((len(label) for label, _ in fold_layers(snap.layers, fold_rows)), default=1))
    columns = [" "] * math.ceil(n / fold)
    for col in range(0, len(columns), TICK_EVERY):
        number = str(col * fold)
        if col + len(number) <= len(columns):
            columns[col : col + len(number)] = number
    return f"{'L':>{width}} " + "".join(columns).rstrip()


def heat_rows(snap: StatsSnapshot, max_columns: int = MAX_COLUMNS, fold_rows: int = 1) -> list[Row]:
    """One row per layer (per run of `fold_rows` layers: the busiest of them, cached in any of them)."""
    rows = []
    peak = max((max(ls.use_counts, default=0) for ls in snap.layers), default=0)
    scale = (len(SHADES) - 2) / math.log1p(peak) if peak else 0.0
    runs = fold_layers(snap.layers, fold_rows)
    width = max((len(label) for label, _ in runs), default=1)
    for label, run in runs:
        n = len(run[0].use_counts)
        counts = [max(ls.use_counts[e] for ls in run) for e in range(n)]
        fold = max(1, math.ceil(n / max_columns))
        cached: set[int] = set().union(*(ls.cached for ls in run))
        cells = []
        for start in range(0, n, fold):
            span = range(start, min(n, start + fold))
            use = max(counts[e] for e in span)
            level = 0 if use == 0 else 1 + int(scale * math.log1p(use))
            char = SHADES[min(level, len(SHADES) - 1)]
            # Cached experts stand out in reverse video: visible in 16 colours and in monochrome.
            cells.append((char if char != " " else "·", not cached.isdisjoint(span)))
        row: Row = [(f"{label:>{max(3, width)}} ", "")]
        # Characters of one style go in one run: one segment each.
        for is_cached, same in groupby(cells, key=itemgetter(1)):
            row.append(("".join(c for c, _ in same), CACHED if is_cached else ""))
        rows.append(row)
    return rows


class ExpertHeatmap(RowsView):
    def __init__(self, **kw: object) -> None:
        super().__init__("", **kw)
        self.snapshot: StatsSnapshot | None = None
        self._fold = 1

    def show(self, snap: StatsSnapshot, *, redraw: bool = True, fold: int = 1) -> None:
        """Keep the snapshot; draw it when told (and for a new fold)."""
        self.snapshot = snap
        if redraw or fold != self._fold:
            self._fold = fold
            self.set_rows(heat_rows(snap, fold_rows=fold) or [[("", "")]])
