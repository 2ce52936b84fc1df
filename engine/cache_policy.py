"""ClassLRU: which experts of a group of layers hold the device slots, and which misses go to the CPU.

Pure Python, no torch: the engine calls it for every cached lookup and the tuner's simulator
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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

N_CLASS = 8
CRF_HALF_LIFE = 128.0  # tokens of the layer's clock
SHARE_ONE = 1 << 16  # the CPU share is kept in 1/65536


class CachePolicyError(RuntimeError):
    """A lookup the cache cannot serve (more distinct experts than slots)."""


@dataclass(frozen=True)
class Plan:
    """What one lookup decided. Experts are ids within the layer."""

    hits: tuple[int, ...]  # already in a slot
    uploads: tuple[tuple[int, int], ...]  # (expert, slot) to fill from the host copy, in expert order
    cpu: tuple[int, ...]  # misses computed on the CPU from the host copy, not cached
    evicted: tuple[tuple[int, int], ...]  # (layer, expert) that lost their slot


class ClassLRU:
    """The slots of one group of layers with the same expert geometry."""

    def __init__(self, layers: Sequence[int], n_expert: int, n_slots: int) -> None:
        if n_slots <= 0:
            raise ValueError(f"a cache needs at least one slot, got {n_slots}")
        self.layers = tuple(layers)
        self.n_expert = n_expert
        self.n_slots = n_slots
        self.slot_map: dict[int, list[int]] = {il: [-1] * n_expert for il in self.layers}  # -1: not cached
        self.key_of = [-1] * n_slots  # (layer, expert) key in each slot, -1 if empty
        # Doubly linked LRU lists, one per class; all slots start empty in class 0, in slot order.
        self.prev = [s - 1 for s in range(n_slots)]
        self.next = [s + 1 if s + 1 < n_slots else -1 for s in range(n_slots)]
        self.head = [0] + [-1] * (N_CLASS - 1)
        self.tail = [n_slots - 1] + [-1] * (N_CLASS - 1)
        self.list_of = [0] * n_slots
        self.n_filled = 0
        self.crf: dict[int, float] = {}  # key -> CRF at its last use
        self.last_use: dict[int, int] = {}  # key -> layer clock at its last use
        self.clock = dict.fromkeys(self.layers, 0)
        self._selected: set[int] = set()  # keys selected by the lookup in progress

    @property
    def full(self) -> bool:
        return self.n_filled == self.n_slots

    def key(self, layer: int, expert: int) -> int:
        return layer * self.n_expert + expert

    def slot_of(self, layer: int, expert: int) -> int:
        return self.slot_map[layer][expert]

    def _move(self, s: int, c: int) -> None:
        """Put slot s at the tail (most recent end) of class list c."""
        frm = self.list_of[s]
        if frm == c and s == self.tail[frm]:
            return
        prev, nxt = self.prev, self.next
        if prev[s] >= 0:
            nxt[prev[s]] = nxt[s]
        else:
            self.head[frm] = nxt[s]
        if nxt[s] >= 0:
            prev[nxt[s]] = prev[s]
        else:
            self.tail[frm] = prev[s]
        prev[s], nxt[s] = self.tail[c], -1
        if self.tail[c] >= 0:
            nxt[self.tail[c]] = s
        else:
            self.head[c] = s
        self.tail[c] = s
        self.list_of[s] = c

    def class_of(self, key: int) -> int:
        return _class(self.crf[key])

    def _victim(self) -> int:
        best, best_score = -1, -1.0
        for c in range(N_CLASS):
            s = self.head[c]
            while s >= 0 and self.key_of[s] in self._selected:
                s = self.next[s]
            if s < 0:
                continue
            key = self.key_of[s]
            if key < 0:
                return s  # an empty slot
            age = self.clock[key // self.n_expert] - self.last_use[key]
            score = math.ldexp(float(age), -c)
            if score > best_score:
                best, best_score = s, score
        if best < 0:
            raise CachePolicyError("no slot can be evicted")
        return best

    def plan(self, layer: int, ids: Sequence[int], n_tokens: int, n_cpu: Callable[[int], int] | None = None) -> Plan:
        """Give a slot to each expert that `ids` (n_tokens x experts used) selects in `layer`.

        `n_cpu(n_misses)` says how many of the misses the CPU takes; it is asked only when the
        group is full. Advances the layer's clock by n_tokens.
        """
        uniq = list(dict.fromkeys(ids))  # distinct, in order of first selection
        if len(uniq) > self.n_slots:
            raise CachePolicyError(
                f"layer {layer}: the lookup selects {len(uniq)} distinct experts but the cache has {self.n_slots} slots"
            )
        slots = self.slot_map[layer]
        base = layer * self.n_expert
        hits: list[int] = []
        misses: list[int] = []
        crf, last_use, now = self.crf, self.last_use, self.clock[layer]
        for e in uniq:
            # The CRF update and class, inline: this loop runs for every expert of every decode step.
            key = base + e
            c = crf.get(key)
            c = c * 2.0 ** ((last_use[key] - now) / CRF_HALF_LIFE) + 1.0 if c else 1.0
            crf[key] = c
            last_use[key] = now
            s = slots[e]
            if s >= 0:
                self._move(s, _class(c))
                hits.append(e)
            else:
                misses.append(e)
        cpu: list[int] = []
        if misses and n_cpu is not None and self.full:
            n_c = min(n_cpu(len(misses)), len(misses))
            if n_c > 0:
                # The least used misses go to the CPU; one that keeps being used gains CRF and is cached.
                misses.sort(key=lambda e: (self.crf[base + e], e))
                cpu, misses = sorted(misses[:n_c]), misses[n_c:]
        misses.sort()
        uploads: list[tuple[int, int]] = []
        evicted: list[tuple[int, int]] = []
        if misses:
            self._selected = {base + e for e in uniq}  # victims skip what this lookup uses
        for e in misses:
            s = self._victim()
            old = self.key_of[s]
            if old >= 0:
                ol, oe = divmod(old, self.n_expert)
                self.slot_map[ol][oe] = -1
                evicted.append((ol, oe))
            else:
                self.n_filled += 1
            key = base + e
            self.key_of[s] = key
            slots[e] = s
            self._move(s, self.class_of(key))
            uploads.append((e, s))
        self.clock[layer] += n_tokens
        self._selected = set()
        return Plan(tuple(hits), tuple(uploads), tuple(cpu), tuple(evicted))


def _class(crf: float) -> int:
    """floor(log2(crf)) for crf >= 1, capped at the last class."""
    return min(N_CLASS - 1, int(crf).bit_length() - 1)


class CpuShare:
    """How many misses go to the CPU: `share` of them on average, per layer, carried in 1/65536."""

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

    def for_layer(self, layer: int) -> Callable[[int], int] | None:
        if self.q == 0:
            return None
        return lambda n: self.take(layer, n)
