"""Layer x expert heat map of use, cached experts marked."""

from __future__ import annotations

import math

from moechat.engine.stats import StatsSnapshot
from rich.text import Text
from textual.widgets import Static

SHADES = " .:-=+*#%@"
MAX_COLUMNS = 64  # wider layers are folded: a column then shows the busiest of its experts


def heat_rows(snap: StatsSnapshot, max_columns: int = MAX_COLUMNS) -> list[Text]:
    rows = []
    peak = max((max(ls.use_counts, default=0) for ls in snap.layers), default=0)
    for ls in snap.layers:
        n = len(ls.use_counts)
        fold = max(1, math.ceil(n / max_columns))
        cached = set(ls.cached)
        line = Text(f"{ls.layer:>3} ")
        for start in range(0, n, fold):
            span = range(start, min(n, start + fold))
            use = max(ls.use_counts[e] for e in span)
            level = 0 if use == 0 or peak == 0 else 1 + int((len(SHADES) - 2) * math.log1p(use) / math.log1p(peak))
            char = SHADES[min(level, len(SHADES) - 1)]
            # Cached experts stand out in reverse video: visible in 16 colours and in monochrome.
            line.append(char if char != " " else "·", style="reverse cyan" if cached.intersection(span) else "")
        rows.append(line)
    return rows


class ExpertHeatmap(Static):
    DEFAULT_CSS = "ExpertHeatmap { height: auto; }"

    def __init__(self, **kw: object) -> None:
        super().__init__("", **kw)  # type: ignore[arg-type]
        self.snapshot: StatsSnapshot | None = None

    def show(self, snap: StatsSnapshot) -> None:
        self.snapshot = snap
        self.update(Text("\n").join(heat_rows(snap)))
