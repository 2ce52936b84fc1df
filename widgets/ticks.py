"""Whole-number ticks for a token axis, shared by the dashboard's chart and the exported report's (no UI
library here: the report is written without one)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def whole_ticks(xs: Sequence[float], most: int = 6) -> list[int]:
    """At most `most` whole-number ticks spanning xs, at a round step (1, 2, 5, 10, 20, 50, ...): a token
    axis has no fractions (plotext's own ticks fall on 2.5 and 7.5 where a reply has few points)."""
    lo, hi = math.floor(min(xs, default=0)), math.ceil(max(xs, default=0))
    step = 1
    while (hi - lo) / step > most - 1:
        step = step * 5 // 2 if str(step)[0] == "2" else step * 2
    first = -(-lo // step) * step
    return list(range(first, hi + 1, step)) or [lo]
