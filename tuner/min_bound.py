"""The MIN bound the app shows after each reply: the hit rate Belady's MIN (the offline optimum, with
bypass) would have had on the cache's recent lookups at the cache's size, beside the cache's own.

The lookups come from the cache's log (`engine/cache/lookup_log.py`, which the compiled lookup
appends to, so it lives with the cache); MIN is the reference policy of `baselines.py`. This module
holds what joins them: the bound's type, which the engine process sends and the dashboard, the
exports and a server's clients show, and its computation. It imports the simulator only when a bound
is computed: the UI process names the type and loads no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moechat.engine.cache.expert_cache import ExpertCache
    from moechat.engine.cache.stats import GroupInfo


@dataclass(frozen=True)
class MinBound:
    """MIN's hit rate (with bypass) at the cache's size, and the cache's own, on the same lookups: the
    session's from the warm start (`from_start`) or its last `tokens` tokens."""

    rate: float
    hit_rate: float
    tokens: int
    from_start: bool


def min_hit_rate(groups: Sequence[GroupInfo], n_expert_used: int, max_batch: int,
                 records: Sequence[tuple[int, int, tuple[int, ...]]],
                 preload: Sequence[tuple[int, int]] = ()) -> float | None:  # fmt: skip
    """The hit rate MIN with bypass would have had on `records` with the slots of `groups` (a
    cache's), starting with `preload` (layer, expert) in them as the cache did (a warm start); None
    without a lookup that goes through a cache."""
    from moechat.tuner.baselines import simulate_baseline
    from moechat.tuner.simulator import Group, Routing

    routing = Routing(tuple(Group(g.layers, g.n_expert, g.expert_bytes) for g in groups), n_expert_used, max_batch,
                      tuple(records))  # fmt: skip
    res = simulate_baseline(routing, [g.n_slots for g in groups], "min-bypass", warmup=0, preload=preload)
    return res.hit_rate if res.lookups else None


def cache_bound(cache: ExpertCache) -> MinBound | None:
    """The bound on the cache's log window, MIN starting from the slots as they were at the window's
    start; None while no lookup went through the cache."""
    w = cache.log.window()
    rate = min_hit_rate([g.info for g in cache.groups], cache.n_expert_used, cache.settings.max_batch, w.records,
                        w.preload)  # fmt: skip
    if rate is None:
        return None
    return MinBound(rate, w.hits / w.lookups if w.lookups else 0.0, w.tokens, w.from_start)
