"""Timing bounds that scale with the machine: a measured unit of work, not a fixed number of seconds."""

from __future__ import annotations

import math
import time


def baseline_seconds() -> float:
    """Seconds this machine takes now for a fixed pure-Python workload (best of 5).

    About 9 ms on the 2-core development machine; a loaded or slower machine takes longer, and
    bounds written as multiples of it move with it."""
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        sum(i * i for i in range(200_000))
        best = min(best, time.perf_counter() - t)
    return best
