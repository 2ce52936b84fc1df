"""ClassLRU: which experts of a group of layers hold the device slots, and which misses go to the CPU.

No torch: the engine calls it for every cached lookup and the tuner's simulator
replays traces through the very same code, so the two cannot disagree.

- CRF (combined recency and frequency) of an expert = its uses, decayed with a half-life of
  128 tokens of its layer's clock; kept across evictions.
- class = floor(log2(CRF)), capped at 7; one LRU list per class; a slot sits in the list of its
  expert's class as of its last use, and a hit moves it to the tail.
- victim: an empty slot, else, among the least recently used slot of each class list (skipping
  experts the current lookup selects), the one with the largest age / 2^class.
- misses fill slots in expert order, so consecutive experts tend to land in consecutive slots.
- CPU share: once every slot of the group holds an expert, a share of the misses, lowest CRF
  first, is computed on the CPU instead of uploaded; the share is exact on average through a
  carry in 1/65536 per layer.
- Admission (`--moe-cache-policy`, default "classlru": every miss is admitted): once the group is
  full, a variant may keep some of the remaining misses out of the slots; they are computed on
  the CPU, as the CPU share's are. "second-use" admits an expert only if its layer used it within
  the last `SECOND_USE_WINDOW` tokens; "upload-cap" uploads at most `UPLOAD_CAP` per token and
  lookup, the most used first; "protect" admits a miss only if its CRF is at least the decayed
  CRF of the slot's current expert (TinyLFU's rule, with this cache's counts).

The engine asks at every MoE layer of every token and the simulator replays millions of lookups:
the per-lookup work is compiled (`lru_core`), over the group's state in two flat arrays, with the
class lists as linked lists of slots and the CRF decay from a table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np

from .rules import (  # noqa: F401 (the policy's numbers, named here too)
    ADMISSIONS,
    CRF_HALF_LIFE,
    N_CLASS,
    N_DECAY,
    POLICIES,
    PROTECT_RATIO,
    SECOND_USE_WINDOW,
    SHARE_ONE,
    UPLOAD_CAP,
)
from .stats import Counters, CountersSnapshot

_NO_KEYS = np.zeros(0, np.int64)


class CachePolicyError(RuntimeError):
    """A lookup the cache cannot serve (more distinct experts than slots)."""


class Plan:
    """What one lookup decided. Experts are ids within the layer.

    hits: already in a slot; uploads: (expert, slot) to fill from the host copy, in expert order;
    cpu: misses computed on the CPU from the host copy, not cached; evicted: (layer, expert) that lost
    their slot; prefetched_hits: hits on experts a prefetch put in their slots, used for the first
    time. The policy's result region is kept as one array (`v`: hits, cpu, uploads' experts, their
    slots, evictions' layers, their experts) and read as tuples only when asked: the engine at each
    layer needs the counts and the arrays.
    """

    __slots__ = ("n_cpu", "n_evicted", "n_hits", "n_uploads", "prefetched_hits", "v")

    def __init__(self, v: np.ndarray, n_hits: int, n_cpu: int = 0, n_uploads: int = 0, n_evicted: int = 0,
                 prefetched_hits: int = 0) -> None:  # fmt: skip
        self.v = v
        self.n_hits, self.n_cpu, self.n_uploads, self.n_evicted = n_hits, n_cpu, n_uploads, n_evicted
        self.prefetched_hits = prefetched_hits

    @classmethod
    def of(cls, hits: Sequence[int], uploads: Sequence[tuple[int, int]], cpu: Sequence[int],
           evicted: Sequence[tuple[int, int]], prefetched_hits: int = 0) -> Plan:  # fmt: skip
        v = [*hits, *cpu, *(e for e, _ in uploads), *(s for _, s in uploads), *(la for la, _ in evicted),
             *(e for _, e in evicted)]  # fmt: skip
        return cls(np.array(v, np.int64), len(hits), len(cpu), len(uploads), len(evicted), prefetched_hits)

    @property
    def cpu_array(self) -> np.ndarray:
        return self.v[self.n_hits : self.n_hits + self.n_cpu]

    @property
    def device_array(self) -> np.ndarray:
        """The experts the device computes: the hits, then the uploaded experts."""
        a = self.n_hits + self.n_cpu
        return np.concatenate((self.v[: self.n_hits], self.v[a : a + self.n_uploads]))

    @property
    def hits(self) -> tuple[int, ...]:
        return tuple(self.v[: self.n_hits].tolist())

    @property
    def cpu(self) -> tuple[int, ...]:
        return tuple(self.cpu_array.tolist())

    @property
    def uploads(self) -> tuple[tuple[int, int], ...]:
        a, n = self.n_hits + self.n_cpu, self.n_uploads
        return tuple(zip(self.v[a : a + n].tolist(), self.v[a + n : a + 2 * n].tolist(), strict=True))

    @property
    def evicted(self) -> tuple[tuple[int, int], ...]:
        a, n = self.n_hits + self.n_cpu + 2 * self.n_uploads, self.n_evicted
        return tuple(zip(self.v[a : a + n].tolist(), self.v[a + n : a + 2 * n].tolist(), strict=True))

    def __iter__(self) -> Iterator[object]:
        return iter((self.hits, self.uploads, self.cpu, self.evicted, self.prefetched_hits))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Plan(hits={self.hits}, uploads={self.uploads}, cpu={self.cpu}, evicted={self.evicted}, "
                f"prefetched_hits={self.prefetched_hits})")  # fmt: skip


def bypasses(n_tokens: int, n_used: int, n_expert: int, n_slots: int, max_batch: int) -> bool:
    """Whether a lookup goes around the cache (its experts read from the host for this call only):
    no slots, a batch larger than `max_batch` (prefill), or more distinct experts than it could
    select than there are slots. The engine, its replay and the baseline policies all ask this."""
    return n_slots == 0 or n_tokens > max_batch or min(n_tokens * n_used, n_expert) > n_slots


def count_bypass(c: Counters, n_tokens: int, n_distinct: int, expert_bytes: int) -> None:
    """Add a lookup that went around the cache, of `n_distinct` experts, to `c`. The planned lookups
    are counted by the policy itself (`ClassLRU.counted`), for the engine and its replay alike."""
    c.calls += 1
    c.tokens += n_tokens
    c.bypassed += n_distinct
    c.bypassed_bytes += n_distinct * expert_bytes


def count_prefetch(c: Counters, n_uploads: int, expert_bytes: int) -> None:
    """Add a prefetch's uploads to `c` (the engine and its replay both count through this)."""
    c.prefetched += n_uploads
    c.prefetched_bytes += n_uploads * expert_bytes


def count_prediction(c: Counters, predicted: Sequence[int] | np.ndarray, selected: Sequence[int] | np.ndarray) -> None:
    """Add a lookup's prediction to `c`: its distinct experts, and how many of them the lookup selected (the
    engine and its replay both count through this)."""
    ahead = set(predicted.reshape(-1).tolist() if isinstance(predicted, np.ndarray) else predicted)
    c.predicted += len(ahead)
    c.predicted_used += len(ahead.intersection(selected.reshape(-1).tolist() if isinstance(selected, np.ndarray)
                                               else selected))  # fmt: skip


class MissSplit(Protocol):
    def take(self, layer: int, n_misses: int) -> int: ...


class ClassLRU:
    """The slots of one group of layers with the same expert geometry; `admission` names the rule by which
    a full group admits misses (ADMISSIONS).

    The state lives in two flat arrays that the compiled steps of `lru_core` update; the attributes
    below are views of them (slot_map, key_of, list_of, crf, last_use, clock) or built on demand
    (lists, prefetched) for inspection.
    """

    def __init__(self, layers: Sequence[int], n_expert: int, n_slots: int, admission: str = "classlru") -> None:
        if n_slots <= 0:
            raise ValueError(f"a cache needs at least one slot, got {n_slots}")
        if admission not in POLICIES:
            raise ValueError(f"unknown cache policy '{admission}' (choose from {', '.join(POLICIES)})")
        from . import lru_core as core  # compiles on first use: the UI process names policies without it

        self._core = core
        self.admission = admission
        self.layers = tuple(layers)
        self.n_expert = n_expert
        self.n_slots = n_slots
        n_layers = max(self.layers) + 1 if self.layers else 0
        self._st, self._fl = core.new_state(n_layers, n_expert, n_slots, ADMISSIONS[admission])
        self._out = core.new_out(n_expert)
        self._result = core.O_HEADER + core.O_RESULT * n_expert  # where a plan lies compactly in _out
        self._no_log = np.zeros(0, np.int32)
        st, n_keys = self._st, n_layers * n_expert
        self.key_of = core.region(st, core.H_KEY, n_slots)  # key (layer * n_expert + expert) in each slot, -1 empty
        self.list_of = core.region(st, core.H_LIST, n_slots)  # each slot's class list
        self.clock = core.region(st, core.H_CLOCK, n_layers)  # per layer: tokens it has seen
        self.last_use = core.region(st, core.H_LAST, n_keys)  # layer clock at each key's last use
        self.crf = self._fl[core.N_DECAY :]  # CRF at each key's last use; 0: never used
        slots, uses = core.region(st, core.H_SLOT, n_keys), core.region(st, core.H_USES, n_keys)
        # Per layer, each expert's slot (-1: not cached): views the kernels read as they are.
        self.slot_map: dict[int, np.ndarray] = {il: slots[il * n_expert : (il + 1) * n_expert] for il in self.layers}
        self._uses = {il: uses[il * n_expert : (il + 1) * n_expert] for il in self.layers}

    @property
    def full(self) -> bool:
        return self.n_filled == self.n_slots

    @property
    def n_filled(self) -> int:
        return int(self._st[self._core.H_FILLED])

    @property
    def lists(self) -> list[list[int]]:
        """Each class's LRU list of slots, least recent first."""
        st, nxt = self._st, self._core.region(self._st, self._core.H_NEXT, self.n_slots)
        out = []
        for c in range(N_CLASS):
            items, s = [], int(st[st[self._core.H_HEAD] + c])
            while s >= 0:
                items.append(s)
                s = int(nxt[s])
            out.append(items)
        return out

    @property
    def prefetched(self) -> set[int]:
        """Slots a prefetch filled whose expert has not been used since."""
        return {int(s) for s in np.flatnonzero(self._core.region(self._st, self._core.H_PREF, self.n_slots))}

    def key(self, layer: int, expert: int) -> int:
        return layer * self.n_expert + expert

    def uses(self, layer: int) -> np.ndarray:
        """Selections of each expert of `layer` by the lookups planned so far (every token's): a view."""
        return self._uses[layer]

    def slot_of(self, layer: int, expert: int) -> int:
        return int(self.slot_map[layer][expert])

    def slot_array(self, layer: int) -> np.ndarray:
        """slot_map[layer]: int64 [n_expert], -1 where not cached; current, not a copy."""
        return self.slot_map[layer]

    def preload(self, picks: Sequence[tuple[int, int, float]]) -> list[tuple[int, int, int]]:
        """Warm start: put (layer, expert, CRF) into empty slots, in order, before any lookup.

        Each takes the CRF it had when saved, as of clock 0; returns (layer, expert, slot) placed.
        """
        placed = []
        nxt = self._core.region(self._st, self._core.H_NEXT, self.n_slots)
        for layer, e, c in picks:
            if self.n_filled == self.n_slots or self.slot_map[layer][e] >= 0:
                continue
            s = int(self._st[self._st[self._core.H_HEAD]])  # empty slots lead class 0: its first empty one
            while self.key_of[s] >= 0:
                s = int(nxt[s])
            key = self.key(layer, e)
            self.crf[key], self.last_use[key] = c, self.clock[layer]
            self._core.place(self._st, self._fl, layer, e, s)
            placed.append((layer, e, s))
        return placed

    def decayed(self, key: int) -> float:
        """A key's CRF decayed to its layer's clock now."""
        dt = int(self.clock[key // self.n_expert] - self.last_use[key])
        return float(self.crf[key]) * (float(self._fl[dt]) if dt < N_DECAY else 2.0 ** (-dt / CRF_HALF_LIFE))

    def decayed_crf(self, layer: int) -> list[float]:
        """Each expert's CRF of `layer` decayed to the layer's clock now (0: never used)."""
        base = layer * self.n_expert
        return [self.decayed(base + e) for e in range(self.n_expert)]

    def plan(self, layer: int, ids: Sequence[int] | np.ndarray, n_tokens: int, share: CpuShare | None = None) -> Plan:
        """Give a slot to each expert that `ids` (n_tokens x experts used) selects in `layer`.

        Once the group is full, `share` of the misses (lowest CRF first) go to the CPU, exact on
        average through a carry per layer in the policy's state. Advances the layer's clock by n_tokens.
        """
        self.set_share(share)
        r = self._core.step(self._st, self._fl, layer, np.asarray(ids, np.int64), n_tokens, self._out, self._no_log)
        if r < 0:
            raise self.refused(layer, r)
        return self.last_plan()

    def step(self, layer: int, ids: np.ndarray, n_tokens: int, log: np.ndarray) -> int:
        """The engine's lookup of `ids` (int64, token-major): `plan` at the group's share (`set_share`),
        without building the plan (`last_plan` builds it), the lookup appended to `log` when it has
        room (`lookup_log.LookupLog.buf`). Returns the hits on prefetched experts, plus `LOGGED`
        when the log took the lookup; negative: refused (`refused` says why)."""
        return int(self._core.step(self._st, self._fl, layer, ids, n_tokens, self._out, log))

    def step_token(self, layers: np.ndarray, ids: np.ndarray, log: np.ndarray, res: np.ndarray) -> int:
        """`step` for one decode token at several of the group's layers (int64 [n]) in one call, ids [n, k]
        in the same order: each row's result, hits and uploads into res [n, 3]. Returns the rows' uploads
        where every lookup was planned and logged, else -1 (res says which was refused or not logged)."""
        return int(self._core.step_rows(self._st, self._fl, layers, ids, self._out, log, res))

    def step_token_ahead(self, layers: np.ndarray, ids: np.ndarray, ahead: np.ndarray, fetch: bool, log: np.ndarray,
                         res: np.ndarray) -> int:  # fmt: skip
        """`step_token` with each row's prediction for the next layer (ahead [n, k], -1 where none) taken after
        its lookup, as `prefetch` takes it (sparing the row's experts) where `fetch`; res [n, 4] adds each
        prefetch's uploads. The next layers are the group's own."""
        return int(self._core.step_ahead_rows(self._st, self._fl, layers, ids, ahead, fetch, self._out, log, res))

    def token_stepper(self) -> tuple[Callable[..., int], np.ndarray, np.ndarray, np.ndarray]:
        """`step_token`'s compiled function and the arrays it takes first: (f, st, fl, out), called as
        f(st, fl, layers, ids, out, log, res) by a caller that counts microseconds per token."""
        return self._core.step_rows, self._st, self._fl, self._out

    def set_share(self, share: CpuShare | None) -> None:
        """The CPU share `step` takes of a full group's misses."""
        self._st[self._core.H_SHARE] = share.q if share is not None else 0

    def last_counts(self) -> tuple[int, int]:
        """(hits, uploads) of the last lookup, without building its plan."""
        return int(self._out[0]), int(self._out[4])

    def last_plan(self) -> Plan:
        """The plan of the last lookup."""
        out, res = self._out, self._result
        n_h, _, n_p, n_c, n_up, n_ev = out[:6].tolist()
        return Plan(out[res : res + n_h + n_c + 2 * n_up + 2 * n_ev].copy(), n_h, n_c, n_up, n_ev, n_p)

    def refused(self, layer: int, r: int) -> CachePolicyError:
        """The error of a lookup `step` refused with result r."""
        if r == -1:
            return CachePolicyError("no slot can be evicted")
        return CachePolicyError(
            f"layer {layer}: the lookup selects {-2 - r} distinct experts but the cache has {self.n_slots} slots"
        )

    @property
    def counting(self) -> bool:
        """Whether planned lookups are counted (the replay counts only after its warm-up)."""
        return bool(self._st[self._core.H_COUNTING])

    @counting.setter
    def counting(self, on: bool) -> None:
        self._st[self._core.H_COUNTING] = int(on)

    def counted(self, layer: int, expert_bytes: int) -> tuple[CountersSnapshot, CountersSnapshot]:
        """The counters of `layer`'s planned lookups: (small batches, large batches)."""
        core = self._core
        at = int(self._st[core.H_COUNT]) + layer * 2 * core.N_COUNT
        values = self._st[at : at + 2 * core.N_COUNT].tolist()
        out = []
        for half in (values[: core.N_COUNT], values[core.N_COUNT :]):
            c = dict(zip(core.COUNTED, half, strict=True))
            out.append(CountersSnapshot(**c, uploaded_bytes=c["uploads"] * expert_bytes))
        return out[0], out[1]

    def prefetch(self, layer: int, experts: Sequence[int], spare: tuple[int, Sequence[int] | np.ndarray] | None = None,
                 ) -> tuple[tuple[int, int], ...]:  # fmt: skip
        """Put predicted experts of `layer` in slots ahead of its lookup: (expert, slot) to upload.

        No use is counted (CRF and clock stay): the lookup that follows counts the experts it
        selects. Victims are chosen as for misses, sparing the predicted experts and `spare`'s
        (layer, experts): the lookup just made, whose experts are still to be read from their slots.
        Of the distinct predicted experts, as many as the other slots can hold, best first.
        """
        out, n_expert, at = self._out, self.n_expert, self._core.O_HEADER
        if spare is None or spare[0] not in self.slot_map:  # (another group's lookup: other slots)
            keys = _NO_KEYS
        else:
            keys = np.asarray(spare[1], np.int64).reshape(-1) + spare[0] * n_expert
        n = self._core.prefetch(self._st, self._fl, layer, np.asarray(experts, np.int64), keys, out)
        if n < 0:
            raise CachePolicyError("no slot can be evicted")
        es = out[at + self._core.O_UP_E * n_expert : at + self._core.O_UP_E * n_expert + n].tolist()
        ss = out[at + self._core.O_UP_S * n_expert : at + self._core.O_UP_S * n_expert + n].tolist()
        return tuple(zip(es, ss, strict=True))


def split_budget(
    groups: Sequence[tuple[int, int, int]], budget_bytes: int, n_expert_used: int
) -> list[tuple[int, int]]:
    """(n_slots, budget bytes) for each group of (n_layers, n_expert, expert_bytes).

    Each group gets the budget in proportion to its expert bytes, so every group caches the same
    fraction of its experts. A group whose slots cannot hold one token's experts gets none.
    The engine sizes its banks with this and the simulator replays with it.
    """
    total = sum(n_layers * n_expert * expert_bytes for n_layers, n_expert, expert_bytes in groups)
    out = []
    for n_layers, n_expert, expert_bytes in groups:
        share = budget_bytes * n_layers * n_expert * expert_bytes // total if total else 0
        n_slots = min(share // expert_bytes, n_layers * n_expert)
        out.append((int(n_slots) if n_slots >= n_expert_used else 0, int(share)))
    return out


def closed_form_share(link_gbps: float, cpu_gbps: float) -> float:
    """The share of a full cache's misses for the CPU by the closed form of the design this cache comes from:
    1 - link/CPU within [0, 1], in the speeds each reads an expert's bytes at: none where the link brings
    experts at least as fast as the CPU computes them, more the faster the CPU is (no CPU speed known: 0).
    The auto share (share_auto) and the tuner's time model both use it."""
    if not cpu_gbps > 0:
        return 0.0
    return float(min(1.0, max(0.0, 1.0 - link_gbps / cpu_gbps)))


class CpuShare:
    """How many misses go to the CPU: `share` of them on average, per layer, carried in 1/65536.

    The policy's compiled lookup keeps its own carry per layer at this share (`ClassLRU.set_share`);
    `take` is the same rule in Python, for the reference implementations the tests hold it to."""

    def __init__(self, share: float) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"CPU share must be in [0, 1], got {share}")
        self.share = share
        self.q = round(share * SHARE_ONE)
        self.carry: dict[int, int] = {}

    def take(self, layer: int, n_misses: int) -> int:
        v = n_misses * self.q + self.carry.get(layer, 0)
        self.carry[layer] = v & (SHARE_ONE - 1)
        return v >> 16

    def active(self) -> CpuShare | None:
        """Itself when it sends anything to the CPU, else None (the policy then skips asking)."""
        return self if self.q else None
