"""Layer x expert heat map of use, cached experts marked."""

from __future__ import annotations

import math
import time

from moechat.engine.stats import StatsSnapshot
from rich.text import Text
from textual.widgets import Static

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
        run: list[str] = []
        run_cached = False  # characters of one style go in one span: far cheaper to draw
        for start in range(0, n, fold):
            span = range(start, min(n, start + fold))
            use = max(ls.use_counts[e] for e in span)
            level = 0 if use == 0 else 1 + int(scale * math.log1p(use))
            char = SHADES[min(level, len(SHADES) - 1)]
            # Cached experts stand out in reverse video: visible in 16 colours and in monochrome.
            is_cached = not cached.isdisjoint(span)
            if run and is_cached != run_cached:
                line.append("".join(run), style=CACHED if run_cached else "")
                run = []
            run.append(char if char != " " else "·")
            run_cached = is_cached
        if run:
            line.append("".join(run), style=CACHED if run_cached else "")
        rows.append(line)
    return rows


class ExpertHeatmap(Static):
    DEFAULT_CSS = "ExpertHeatmap { height: auto; }"

    def __init__(self, **kw: object) -> None:
        super().__init__("", **kw)  # type: ignore[arg-type]
        self.snapshot: StatsSnapshot | None = None
        self._drawn = 0.0

    def show(self, snap: StatsSnapshot, *, final: bool = False) -> None:
        """Keep the snapshot; redraw at most once a second, and always for the final one."""
        now = time.monotonic()
        first = self.snapshot is None
        if not (first or final or now - self._drawn >= REDRAW_EVERY):
            self.snapshot = snap
            return
        self._drawn = now
        # A fixed height (one row per layer) lets updates redraw without relaying out the screen.
        fixed = not first and self.snapshot is not None and len(self.snapshot.layers) == len(snap.layers)
        if not fixed:
            self.styles.height = max(1, len(snap.layers))
        self.snapshot = snap
        self.update(Text("\n").join(heat_rows(snap)), layout=not fixed)
