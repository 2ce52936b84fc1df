"""Replay a routing trace through the engine's own cache policy, at any cache size and CPU share.

The replay does what `engine.expert_cache.ExpertCache` does per MoE call, minus the arithmetic:
the same budget split into groups (`split_budget`), the same bypass rule for large batches, the
same `ClassLRU` and `CpuShare`, the same counters. Replaying a trace at the size and share it was
recorded with therefore reproduces the engine's counters exactly (tests/test_tuner.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from moechat.engine.cache.policy import (
    ClassLRU,
    CpuShare,
    bypasses,
    count_bypass,
    count_prediction,
    count_prefetch,
    split_budget,
)
from moechat.engine.cache.route_csv import is_route_csv, read_route_csv
from moechat.engine.cache.settings import MAX_BATCH
from moechat.engine.cache.stats import CountersSnapshot, LayerCounters
from moechat.engine.cache.trace import read_trace
from moechat.engine.cache.warm_start import hottest

WARMUP_TOKENS = 64


@dataclass(frozen=True)
class Group:
    layers: tuple[int, ...]
    n_expert: int
    expert_bytes: int

    @property
    def bytes(self) -> int:
        return len(self.layers) * self.n_expert * self.expert_bytes


@dataclass(frozen=True)
class Routing:
    """A trace in memory: the cache geometry it was recorded with and its lookups in order."""

    groups: tuple[Group, ...]
    n_expert_used: int
    max_batch: int
    records: tuple[tuple[int, int, tuple[int, ...]], ...]  # (layer, n_used, ids token-major)
    recorded_mib: float = 0.0
    recorded_share: float = 0.0
    warm: dict[int, list[float]] | None = None  # the saved counts a warm-started cache filled its slots from
    recorded_policy: str = "classlru"
    # A split model's trace (engine/distributed): the groups each stage held. Each stage sized its
    # own slots from the whole budget, so a size here is each stage's. None: one process.
    stages: tuple[tuple[int, ...], ...] | None = None
    recorded_prefetch: bool = False  # whether the engine uploaded its predictions (its records < 0) ahead

    @property
    def predictions(self) -> bool:
        """Whether the trace holds the engine's predictions one layer ahead (records < 0): prefetch can replay."""
        return any(r[0] < 0 for r in self.records)

    @property
    def first_layer(self) -> int:
        return min(layer for g in self.groups for layer in g.layers)

    @property
    def expert_bytes(self) -> int:
        """Bytes of all experts of all layers."""
        return sum(g.bytes for g in self.groups)

    @property
    def n_tokens(self) -> int:
        first = self.first_layer
        return sum(len(ids) // n for layer, n, ids in self.records if layer == first)

    def tokens(self) -> Iterator[int]:
        """For each record, the number of tokens seen so far (counted at the first layer)."""
        first, seen = self.first_layer, 0
        for layer, n, ids in self.records:
            if layer == first:
                seen += len(ids) // n
            yield seen

    def _stages(self) -> tuple[tuple[int, ...], ...]:
        return self.stages if self.stages is not None else (tuple(range(len(self.groups))),)

    def slots(self, mib: float) -> list[int]:
        """Slots of each group in a cache of `mib` MiB (a split: in each stage's cache of `mib` MiB)."""
        budget = int(mib * 2**20)
        out = [0] * len(self.groups)
        for stage in self._stages():
            groups = [self.groups[i] for i in stage]
            got = split_budget([(len(g.layers), g.n_expert, g.expert_bytes) for g in groups], budget,
                               self.n_expert_used)  # fmt: skip
            for i, (n, _) in zip(stage, got, strict=True):
                out[i] = n
        return out

    def full_mib(self) -> float:
        """The smallest cache, in MiB, that holds every expert (a split: every expert of the largest stage)."""
        return max(sum(self.groups[i].bytes for i in stage) for stage in self._stages()) / 2**20

    def layer_steps(self, layer: int) -> list[list[int]]:
        """The experts each token selected in `layer`, token by token, over the whole trace."""
        steps: list[list[int]] = []
        for lay, n, ids in self.records:
            if lay == layer:
                steps += [list(ids[i : i + n]) for i in range(0, len(ids), n)]
        return steps

    @property
    def geometry(self) -> tuple[object, ...]:
        """What two traces must share to be joined: the same model, cache layout and split."""
        return self.groups, self.n_expert_used, self.max_batch, self.stages

    def concat(self, other: Routing) -> Routing:
        if other.geometry != self.geometry:
            raise ValueError("traces of different models cannot be joined")
        return Routing(self.groups, self.n_expert_used, self.max_batch, self.records + other.records,
                       self.recorded_mib, self.recorded_share, self.warm, self.recorded_policy,
                       self.stages, self.recorded_prefetch)  # fmt: skip


def load_routing(path: str | Path) -> Routing:
    """A trace of moechat's (`--moe-cache-trace`), or another engine's route_trace v1 CSV (engine/cache/route_csv)."""
    if is_route_csv(path):
        rt = read_route_csv(path)
        # Replayed as moechat's engine runs: its default batch above which a lookup goes around the cache.
        return Routing(tuple(Group(*bank) for bank in rt.banks), rt.n_expert_used, MAX_BATCH, rt.records)
    tr = read_trace(path)
    h = tr.header
    try:
        groups = tuple(Group(tuple(g["layers"]), int(g["n_expert"]), int(g["expert_bytes"])) for g in h["groups"])
        warm = h.get("warm")
        stages = h.get("stages")  # a split model's trace
        held = tuple(tuple(int(i) for i in st) for st in stages) if stages is not None else None
        routing = Routing(groups, int(h["n_expert_used"]), int(h["max_batch"]),
                          tuple((r.layer, r.n_used, r.ids) for r in tr.records),
                          float(h.get("budget_mib", 0.0)), float(h.get("cpu_share", 0.0)),
                          {int(k): [float(c) for c in v] for k, v in warm.items()} if warm else None,
                          str(h.get("policy", "classlru")),
                          held, bool(h.get("prefetch", False)))  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: trace header lacks or garbles {e}") from None
    if held is not None and sorted(i for st in held for i in st) != list(range(len(groups))):
        raise ValueError(f"{path}: the trace header's stages do not hold each group once")
    known = {layer for g in groups for layer in g.layers}
    for record, _, ids in routing.records:
        layer = record_layer(record)
        if layer not in known:
            raise ValueError(f"{path}: a record names layer {layer}, which no group holds")
        n_expert = next(g.n_expert for g in groups if layer in g.layers)
        if any(not 0 <= e < n_expert for e in ids):
            raise ValueError(f"{path}: layer {layer} selects an expert outside 0..{n_expert - 1}")
    return routing


def record_layer(record: int) -> int:
    """The layer of a record: a prefetch's record (its predicted experts) carries -1 - layer."""
    return -1 - record if record < 0 else record


@dataclass
class SimResult:
    mib: float
    share: float
    n_slots: tuple[int, ...]  # per group
    tokens: int  # tokens counted (after the warm-up)
    layers: dict[int, LayerCounters]
    prefetch: str = "off"  # "off" or "next-layer": whether the predictions were fetched ahead
    cpu_bytes: int = 0  # misses computed on the CPU
    upload_bytes: int = 0  # misses uploaded into slots
    bypass_bytes: int = 0  # experts of bypassing lookups (read from the host for that call only)
    prefetch_bytes: int = 0  # experts uploaded ahead on a prediction

    @property
    def total(self) -> CountersSnapshot:
        out = CountersSnapshot()
        for sl in self.layers.values():
            out = out + sl.total
        return out

    @property
    def hit_rate(self) -> float:
        return self.total.hit_rate

    def per_token(self, n_bytes: int) -> float:
        """GiB per counted token."""
        return n_bytes / 2**30 / max(self.tokens, 1)

    @property
    def upload_gib(self) -> float:
        """GiB moved to the device per token: uploads (prefetched too), and bypassing lookups' host reads."""
        return self.per_token(self.upload_bytes + self.bypass_bytes + self.prefetch_bytes)

    @property
    def cpu_gib(self) -> float:
        return self.per_token(self.cpu_bytes)


def replay(
    routing: Routing,
    mib: float,
    share: float = 0.0,
    *,
    warmup: int = WARMUP_TOKENS,
    until: int | None = None,
    n_slots: Sequence[int] | None = None,
    policy: str | None = None,
    prefetch: str | None = None,
) -> SimResult:
    """Counters of a cache of `mib` MiB (or explicit slots per group) with a CPU share, over the
    tokens after `warmup` and up to `until` (None: the end); the cache runs through all of them.

    `policy`: what the slots admit (cache_policy.POLICIES); None: the one the trace was recorded with.
    `prefetch`: "next-layer" uploads each recorded prediction ahead of its layer's lookup, as the engine does
    (its misses take slots, evicting, and count as prefetched), "off" does not; None: as recorded. Either
    way a prediction's recall is counted at its layer's lookup."""
    if prefetch not in (None, "off", "next-layer"):
        raise ValueError(f"prefetch must be off or next-layer, got '{prefetch}'")
    fetch = routing.recorded_prefetch if prefetch is None else prefetch == "next-layer"
    if fetch and not routing.predictions:
        raise ValueError("the trace holds no predictions to fetch ahead (recorded before moechat wrote them)")
    slots = list(n_slots) if n_slots is not None else routing.slots(mib)
    admission = policy or routing.recorded_policy
    policies: dict[int, tuple[Group, ClassLRU | None]] = {}
    for g, n in zip(routing.groups, slots, strict=True):
        lru = ClassLRU(g.layers, g.n_expert, n, admission) if n > 0 else None
        if lru is not None and routing.warm is not None:  # as the engine's warm start did
            lru.preload(hottest(routing.warm, g.layers, n))
        for layer in g.layers:
            policies[layer] = (g, lru)
    cpu_share = CpuShare(share)
    active = cpu_share.active()
    res = SimResult(mib, share, tuple(slots), 0, {layer: LayerCounters() for layer in policies},
                    "next-layer" if fetch else "off")  # fmt: skip
    max_batch, first = routing.max_batch, routing.first_layer
    seen = 0
    predicted: dict[int, tuple[int, ...]] = {}  # layer -> its last prediction, until its lookup
    last: tuple[int, tuple[int, ...]] | None = None  # the latest lookup (layer, ids)
    for record, n_used, ids in routing.records:
        n_tokens = len(ids) // n_used
        layer = record_layer(record)
        if record == first:
            seen += n_tokens
        count_now = warmup < seen and (until is None or seen <= until)
        if count_now and record == first:
            res.tokens += n_tokens
        g, lru = policies[layer]
        c = res.layers[layer].of(n_tokens)
        bypassed = lru is None or bypasses(n_tokens, n_used, g.n_expert, lru.n_slots, max_batch)
        if record < 0:  # the engine's prediction of this layer's experts, one layer ahead
            predicted[layer] = ids
            if fetch and lru is not None and not bypassed:
                uploads = lru.prefetch(layer, ids, last)  # the engine spares the lookup just made
                if count_now:
                    count_prefetch(c, len(uploads), g.expert_bytes)
                    res.prefetch_bytes += len(uploads) * g.expert_bytes
            continue
        last = None if bypassed else (layer, ids)  # (a lookup around the cache reads no slot)
        ahead = predicted.pop(layer, None)
        if ahead is not None and count_now:
            count_prediction(c, ahead, ids)
        if lru is None or bypassed:
            if count_now:
                n = len(set(ids))
                count_bypass(c, n_tokens, n, g.expert_bytes)
                res.bypass_bytes += n * g.expert_bytes
            continue
        if lru.counting != count_now:
            lru.counting = count_now  # the policy counts its planned lookups after the warm-up only
        plan = lru.plan(layer, ids, n_tokens, active)
        if count_now:
            res.upload_bytes += plan.n_uploads * g.expert_bytes
            res.cpu_bytes += plan.n_cpu * g.expert_bytes
    for layer, (g, lru) in policies.items():
        if lru is not None:
            small, large = lru.counted(layer, g.expert_bytes)
            res.layers[layer].small.add(small)
            res.layers[layer].large.add(large)
    return res
