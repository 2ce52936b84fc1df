"""Reference policies on the same trace and slot geometry: LRU, LFU and Belady's MIN.

They bound and place ClassLRU: MIN (the offline optimum, knowing the future) says how many misses
no policy can avoid, LRU and LFU are the textbook online policies. Requests are event-atomic: the
experts of one (token, layer) lookup are served together and are never each other's victims.
Two MIN variants: forced-admit (every miss is cached, as with CPU share 0) and with bypass (a
miss may be served without caching it, which is what the CPU share does).

MIN is also the bound the app shows after each reply (`MinBound`, `cache_bound`): the hit rate MIN with
bypass would have had on the cache's recent lookups at the cache's size, beside the cache's own. Those
lookups come from the cache's log (`engine/cache/lookup_log.py`: the compiled lookup appends to it, so
it lives with the cache). The engine process sends the bound's type, and the dashboard, the exports
and a server's clients show it; this module imports nothing heavier than numpy, so the UI process
names the type and loads no torch.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moechat.engine.cache.policy import bypasses
from moechat.tuner.simulator import WARMUP_TOKENS, Group, Routing

if TYPE_CHECKING:
    from moechat.engine.cache.expert_cache import ExpertCache
    from moechat.engine.cache.stats import GroupInfo

POLICIES = ("lru", "lfu", "min", "min-bypass")
NEVER = 1 << 62


@dataclass(frozen=True)
class BaselineResult:
    policy: str
    lookups: int  # counted (after the warm-up)
    hits: int
    misses: int
    compulsory: int  # misses of experts never seen before in the trace: no policy avoids them
    by_layer: tuple[tuple[int, int, int], ...] = ()  # (layer, lookups, hits) counted, by layer

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def _events(routing: Routing, n_slots: list[int], warmup: int) -> Iterator[tuple[int, tuple[int, ...], bool]]:
    """(group, distinct keys, counted) of each lookup that goes through a cache, in trace order."""
    group_of = {layer: (i, g) for i, g in enumerate(routing.groups) for layer in g.layers}
    for (layer, n_used, ids), seen in zip(routing.records, routing.tokens(), strict=True):
        if layer < 0:
            continue  # a prefetch record: the references know the future or need no prediction
        gi, g = group_of[layer]
        n_tokens = len(ids) // n_used
        n = n_slots[gi]
        if bypasses(n_tokens, n_used, g.n_expert, n, routing.max_batch):
            continue
        base = layer * g.n_expert
        yield gi, tuple(base + e for e in dict.fromkeys(ids)), seen > warmup


def simulate_baseline(
    routing: Routing, n_slots: list[int], policy: str, warmup: int = WARMUP_TOKENS,
    preload: Sequence[tuple[int, int]] = (),
) -> BaselineResult:  # fmt: skip
    """`policy`'s counters on `routing` with `n_slots` per group; `preload`: (layer, expert) in the slots
    before the first lookup (a warm-started cache's), as many per group as it has slots."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy '{policy}' (choose from {', '.join(POLICIES)})")
    events = list(_events(routing, n_slots, warmup))
    seen: set[tuple[int, int]] = set()
    lookups = hits = misses = compulsory = 0
    # Next use of each key after each event, for MIN: a backward pass per group.
    nxt: list[dict[int, int]] = [{} for _ in events]
    upcoming: list[dict[int, int]] = [{} for _ in routing.groups]  # then: each key's first use
    if policy.startswith("min"):
        for i in range(len(events) - 1, -1, -1):
            gi, keys, _ = events[i]
            nxt[i] = {k: upcoming[gi].get(k, NEVER) for k in keys}
            for k in keys:
                upcoming[gi][k] = i
    caches = [_Cache(policy, n) for n in n_slots]
    group_of = {layer: (i, g) for i, g in enumerate(routing.groups) for layer in g.layers}
    for layer, e in preload:
        gi, g = group_of[layer]
        key = layer * g.n_expert + e
        # MIN's next use of a preloaded expert is its first; LRU and LFU start it unused.
        first_use = upcoming[gi].get(key, NEVER) if policy.startswith("min") else 0
        caches[gi].place(key, first_use)
    per_layer: dict[int, list[int]] = {}
    for i, (gi, keys, counted) in enumerate(events):
        n_hit, missed = caches[gi].access(i, keys, nxt[i])
        if counted:
            lookups += len(keys)
            hits += n_hit
            misses += len(missed)
            counts = per_layer.setdefault(keys[0] // routing.groups[gi].n_expert, [0, 0])
            counts[0] += len(keys)
            counts[1] += n_hit
        for k in missed:
            if (gi, k) not in seen and counted:
                compulsory += 1
        seen.update((gi, k) for k in keys)
    by_layer = tuple((layer, n, h) for layer, (n, h) in sorted(per_layer.items()))
    return BaselineResult(policy, lookups, hits, misses, compulsory, by_layer)


class _Cache:
    def __init__(self, policy: str, capacity: int) -> None:
        self.policy, self.capacity = policy, capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}
        self.state: dict[int, tuple[int, int]] = {}  # key -> its live heap entry (LFU: freq, last; MIN: -next, 0)
        self.heap: list[tuple[int, int, int]] = []

    def place(self, key: int, next_use: int) -> None:
        """Put `key` in a slot before any lookup (a warm start); the slots must have room."""
        if len(self.state) >= self.capacity:
            raise ValueError("more preloaded experts than slots")
        if self.policy == "lru":
            self.lru[key] = None
            return
        entry = (-next_use, 0) if self.policy.startswith("min") else (0, -1)
        self.state[key] = entry
        heapq.heappush(self.heap, (*entry, key))

    def access(self, now: int, keys: tuple[int, ...], nxt: dict[int, int]) -> tuple[int, list[int]]:
        if self.policy == "lru":
            return self._lru(keys)
        hit = [k for k in keys if k in self.state]
        missed = [k for k in keys if k not in self.state]
        request = set(keys)
        for k in keys:
            self.freq[k] = self.freq.get(k, 0) + 1
        for k in missed:
            if len(self.state) >= self.capacity:
                if self.policy == "min-bypass":
                    worst = self._peek(request)
                    if worst is not None and nxt.get(k, NEVER) >= -worst[0]:
                        continue  # needed later than anything cached: serve it without caching
                self._evict(request)
            self.state[k] = (0, 0)
        for k in keys:
            if k in self.state:
                entry = (-nxt.get(k, NEVER), 0) if self.policy.startswith("min") else (self.freq[k], now)
                self.state[k] = entry
                heapq.heappush(self.heap, (*entry, k))
        return len(hit), missed

    def _lru(self, keys: tuple[int, ...]) -> tuple[int, list[int]]:
        lru = self.lru
        hit = 0
        missed = []
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
                hit += 1
            else:
                missed.append(k)
        request = set(keys)
        for k in missed:
            if len(lru) >= self.capacity:
                victim = next(v for v in lru if v not in request)
                del lru[victim]
            lru[k] = None
        return hit, missed

    def _peek(self, request: set[int]) -> tuple[int, int, int] | None:
        """The live heap entry (a, b, key) of the best victim outside the request (left in the heap)."""
        skipped = []
        found = None
        while self.heap:
            a, b, k = self.heap[0]
            if self.state.get(k) != (a, b):
                heapq.heappop(self.heap)  # stale
                continue
            if k in request:
                skipped.append(heapq.heappop(self.heap))
                continue
            found = (a, b, k)
            break
        for item in skipped:
            heapq.heappush(self.heap, item)
        return found

    def _evict(self, request: set[int]) -> None:
        # The victim is the entry _peek found, not the heap's top: the request's own entries, which
        # _peek skipped and put back, may lead the heap and must not be evicted.
        found = self._peek(request)
        if found is None:
            raise ValueError("no expert can be evicted: the cache is smaller than one lookup")
        del self.state[found[2]]  # its heap entry is stale from now on


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
