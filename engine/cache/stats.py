"""Expert-cache statistics: mutable counters inside the engine, frozen snapshots for everyone else."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from .rules import SMALL_BATCH


@dataclass(slots=True)  # counted at every lookup: slots make each increment cheaper
class Counters:
    lookups: int = 0  # distinct experts looked up
    hits: int = 0
    misses: int = 0  # uploads + cpu
    cpu: int = 0  # misses computed on the CPU from the host copy
    uploads: int = 0
    uploaded_bytes: int = 0
    bypassed: int = 0  # distinct experts of batches that bypass the cache
    bypassed_bytes: int = 0
    calls: int = 0
    tokens: int = 0
    prefetched: int = 0  # experts uploaded ahead of their lookup, on a prediction
    prefetched_bytes: int = 0
    prefetch_hits: int = 0  # hits on a prefetched expert (the prediction was right)
    predicted: int = 0  # distinct experts predicted one layer ahead of the lookup (prefetch or trace on)
    predicted_used: int = 0  # of them, those the lookup selected

    def frozen(self) -> CountersSnapshot:
        return CountersSnapshot(**{k: getattr(self, k) for k in self.__dataclass_fields__})

    def add(self, other: CountersSnapshot) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass(frozen=True)
class CountersSnapshot:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    cpu: int = 0
    uploads: int = 0
    uploaded_bytes: int = 0
    bypassed: int = 0
    bypassed_bytes: int = 0
    calls: int = 0
    tokens: int = 0
    prefetched: int = 0
    prefetched_bytes: int = 0
    prefetch_hits: int = 0
    predicted: int = 0
    predicted_used: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def exposed(self) -> int:
        """Lookups whose expert was neither in a slot nor fetched ahead: the misses a token waits for
        (uploads) or computes from the host copy (the CPU share)."""
        return self.misses

    @property
    def missed(self) -> int:
        """Lookups whose expert was not in a slot before its layer's prefetch: the exposed misses and
        those a prefetch fetched in time."""
        return self.misses + self.prefetch_hits

    @property
    def recall(self) -> float:
        """Of the experts predicted one layer ahead, the share the lookup then selected."""
        return self.predicted_used / self.predicted if self.predicted else 0.0

    def __add__(self, other: CountersSnapshot) -> CountersSnapshot:
        return CountersSnapshot(**{k: getattr(self, k) + getattr(other, k) for k in self.__dataclass_fields__})

    def __sub__(self, other: CountersSnapshot) -> CountersSnapshot:
        return CountersSnapshot(**{k: getattr(self, k) - getattr(other, k) for k in self.__dataclass_fields__})


@dataclass
class LayerCounters:
    small: Counters = field(default_factory=Counters)  # batches of <= 8 tokens
    large: Counters = field(default_factory=Counters)

    def of(self, n_tokens: int) -> Counters:
        return self.small if n_tokens <= SMALL_BATCH else self.large

    @property
    def total(self) -> CountersSnapshot:
        return self.small.frozen() + self.large.frozen()


@dataclass(frozen=True)
class GroupInfo:
    index: int
    layers: tuple[int, ...]
    n_expert: int
    expert_bytes: int  # one expert: gate + up + down
    n_slots: int  # 0: not cached
    budget_bytes: int

    @property
    def fraction(self) -> float:
        return self.n_slots / (len(self.layers) * self.n_expert) if self.layers else 0.0


@dataclass(frozen=True)
class LayerSnapshot:
    layer: int
    group: int
    small: CountersSnapshot
    large: CountersSnapshot
    occupancy: int  # slots holding an expert of this layer
    cached: tuple[int, ...]  # experts of this layer in a slot
    use_counts: tuple[int, ...]  # selections per expert since the start

    @property
    def total(self) -> CountersSnapshot:
        return self.small + self.large


@dataclass(frozen=True)
class TierSnapshot:
    """The tier as a whole, frozen: what `moechat run -v` logs and the tests read."""

    n_slots: int
    n_expert_total: int
    slot_bytes: int
    lookups: int
    hits: int
    reads: int  # experts read on demand (planned misses and scratch reads)
    prefetched: int
    prefetch_used: int
    predicted: int
    predicted_used: int
    selected: int
    bytes_read: int
    wait_s: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def recall(self) -> float:
        """Of the experts the layers selected after a prediction, the share that was predicted."""
        return self.predicted_used / self.selected if self.selected else 0.0

    def lines(self) -> list[str]:
        return [
            f"RAM tier: {self.n_slots} of {self.n_expert_total} experts in RAM ({self.slot_bytes / 2**20:.0f} MiB); "
            f"{self.lookups} lookups, hit rate {100 * self.hit_rate:.1f}%, {self.reads} read on demand, "
            f"{self.prefetched} read ahead ({self.prefetch_used} used), prediction recall {100 * self.recall:.1f}%, "
            f"{self.bytes_read / 2**20:.0f} MiB read, {self.wait_s:.2f} s waiting on the disk"
        ]


@dataclass(frozen=True)
class StatsSnapshot:
    time: float  # time.time() when taken
    tokens: int  # tokens through the MoE layers (per layer)
    groups: tuple[GroupInfo, ...]
    layers: tuple[LayerSnapshot, ...]
    cpu_share: float
    warm_uploads: int = 0  # experts put in slots from the saved counts before the first token (warm start)
    warm_bytes: int = 0
    policy: str = "classlru"  # what the slots admit (cache_policy.POLICIES)
    ram: TierSnapshot | None = None  # the experts' RAM tier, where the model has one (cache.ram_tier)

    @property
    def total(self) -> CountersSnapshot:
        out = CountersSnapshot()
        for layer in self.layers:
            out = out + layer.total
        return out


def snapshot_from_dict(d: dict[str, Any]) -> StatsSnapshot:
    """A snapshot back from `dataclasses.asdict` (JSON): what a server's stats stream carries to `moechat attach`."""
    groups = tuple(GroupInfo(**{**g, "layers": tuple(g["layers"])}) for g in d["groups"])
    layers = tuple(
        LayerSnapshot(la["layer"], la["group"], CountersSnapshot(**la["small"]), CountersSnapshot(**la["large"]),
                      la["occupancy"], tuple(la["cached"]), tuple(la["use_counts"]))
        for la in d["layers"]
    )  # fmt: skip
    rest: dict[str, Any] = {k: d[k] for k in ("warm_uploads", "warm_bytes", "policy") if k in d}
    if d.get("ram") is not None:
        rest["ram"] = TierSnapshot(**d["ram"])
    return StatsSnapshot(d["time"], d["tokens"], groups, layers, d["cpu_share"], **rest)


RECENT_TOKENS = 32  # the dashboard's and the export's recent window


@dataclass(frozen=True)
class Recent:
    """The counters of the most recent tokens: `span` tokens (at least the window's, as snapshots fall)."""

    span: int
    total: CountersSnapshot
    layers: tuple[tuple[int, CountersSnapshot], ...]  # (layer, its counters over the span)

    def worst(self, n: int = 2) -> list[tuple[int, float]]:
        """The n layers with the lowest hit rate over the span, (layer, rate), among those looked up."""
        looked = [(c.hit_rate, layer) for layer, c in self.layers if c.lookups]
        return [(layer, rate) for rate, layer in sorted(looked)[:n]]


class RecentWindow:
    """Counters over the last `tokens` tokens, from the cumulative snapshots a reader receives.

    Snapshots come at a bounded rate, not per token, so the window runs from the newest kept
    snapshot at least `tokens` tokens before the latest one: its span is reported, never assumed.
    Counters that start again (a cache rebuilt) start the window again.
    """

    def __init__(self, tokens: int = RECENT_TOKENS) -> None:
        self.tokens = tokens
        self._snaps: deque[StatsSnapshot] = deque()

    def add(self, snap: StatsSnapshot) -> Recent | None:
        """Take the latest snapshot; the recent counters, or None until two snapshots differ in tokens."""
        if self._snaps and snap.tokens < self._snaps[-1].tokens:
            self._snaps.clear()
        self._snaps.append(snap)
        while len(self._snaps) > 2 and self._snaps[1].tokens <= snap.tokens - self.tokens:
            self._snaps.popleft()
        base = self._snaps[0]
        if base.tokens >= snap.tokens:
            return None
        before = {ls.layer: ls.total for ls in base.layers}
        layers = tuple((ls.layer, ls.total - before.get(ls.layer, CountersSnapshot())) for ls in snap.layers)
        total = CountersSnapshot()
        for _, c in layers:
            total = total + c
        return Recent(snap.tokens - base.tokens, total, layers)


def summary_lines(snap: StatsSnapshot) -> list[str]:
    """The seed-style summary printed at exit: hits, misses, uploads per batch class."""
    lines = []
    for name in ("small", "large"):
        tot = None
        for layer in snap.layers:
            c = getattr(layer, name)
            tot = c if tot is None else tot + c
        if tot is None or not (tot.lookups or tot.bypassed):
            continue
        label = "<= 8" if name == "small" else " > 8"
        lines.append(
            f"MoE cache: batch {label}: hits = {tot.hits}, misses = {tot.misses} ({tot.cpu} on the CPU), "
            f"hit rate = {f'{100 * tot.hit_rate:.1f}%' if tot.lookups else 'none (every lookup bypassed)'}, "
            f"uploaded = {tot.uploaded_bytes / 2**20:.1f} MiB, "
            f"bypassed = {tot.bypassed}"
        )
    t = snap.total
    if t.predicted:
        ahead = ", none uploaded ahead"
        if t.prefetched:
            ahead = (f", {t.prefetched} uploaded ahead ({t.prefetched_bytes / 2**20:.1f} MiB, {t.prefetch_hits} "
                     f"used), exposed misses = {t.exposed} of {t.missed}")  # fmt: skip
        lines.append(f"MoE cache: look-ahead: recall = {100 * t.recall:.1f}% of {t.predicted} predicted" + ahead)
    return lines


def merge_stages(stages: list[StatsSnapshot]) -> StatsSnapshot:
    """The snapshots of a split model's stages (rank order) as one: every MoE layer by its own index,
    the groups numbered across the stages. The first stage's time and token count stand for all (each
    stage sees every token); the CPU share and policy are the run's."""
    first = stages[0]
    groups: list[GroupInfo] = []
    layers: list[LayerSnapshot] = []
    for snap in stages:
        shift = len(groups)
        groups += [replace(g, index=g.index + shift) for g in snap.groups]
        layers += [replace(layer, group=layer.group + shift) for layer in snap.layers]
    return replace(
        first,
        groups=tuple(groups),
        layers=tuple(sorted(layers, key=lambda x: x.layer)),
        warm_uploads=sum(s.warm_uploads for s in stages),
        warm_bytes=sum(s.warm_bytes for s in stages),
    )
