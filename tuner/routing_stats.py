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


def reuse_distances(steps: Steps) -> Counter[int]:
    """How many distinct other experts each selection's expert waited through since its last use
    (its LRU stack distance; -1: first use). An LRU cache of c experts of this layer hits exactly
    the selections at distance < c, so the histogram says how the hit rate grows with the cache."""
    stack: OrderedDict[int, None] = OrderedDict()  # least recent first
    out: Counter[int] = Counter()
    for ids in steps:
        for e in dict.fromkeys(ids):
            if e in stack:
                keys = list(stack)
                out[len(keys) - 1 - keys.index(e)] += 1
                stack.move_to_end(e)
            else:
                out[-1] += 1
                stack[e] = None
    return out


def distance_buckets(distances: Counter[int], n_expert: int) -> list[tuple[str, int]]:
    """The histogram in power-of-two buckets (0, 1, 2-3, 4-7, ...) up to n_expert, then first uses."""
    buckets: list[tuple[str, int]] = []
    lo = 0
    while lo < n_expert:
        hi = max(lo, 2 * lo - 1) if lo else 0
        hi = min(hi, n_expert - 1)
        buckets.append((str(lo) if lo == hi else f"{lo}-{hi}", sum(n for d, n in distances.items() if lo <= d <= hi)))
        lo = hi + 1
    buckets.append(("first", distances.get(-1, 0)))
    return buckets
