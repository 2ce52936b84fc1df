"""How cacheable a routing is: skew, reuse between nearby tokens, and what an LRU cache gets.

`steps` is one layer's routing, a list of the experts each token selected. The demo's fitting
script, its routing bench and its test all measure with these, so their numbers mean one thing.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

Steps = Sequence[Sequence[int]]


def top_share(steps: Steps, n_expert: int, fraction: float = 0.2) -> float:
    """Share of the selections served by the most used `fraction` of the experts (uniform: `fraction`)."""
    counts = sorted(Counter(e for ids in steps for e in ids).values(), reverse=True)
    return sum(counts[: max(1, int(n_expert * fraction))]) / max(sum(counts), 1)


def reuse_rate(steps: Steps, window: int = 8) -> float:
    """Share of the selections whose expert was also selected in one of the previous `window` tokens."""
    total = sum(len(ids) for ids in steps)
    reused = sum(1 for t, ids in enumerate(steps) for e in ids
                 if any(e in steps[p] for p in range(max(0, t - window), t)))  # fmt: skip
    return reused / max(total, 1)


def lru_hit_rate(steps: Steps, capacity: int) -> float:
    """Hit rate of a least-recently-used cache of `capacity` experts fed the selections in order."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for ids in steps:
        for e in ids:
            total += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / max(total, 1)
