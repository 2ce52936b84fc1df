"""The expert cache's ClassLRU as it was written in pure Python (OrderedDict class lists), before the
engine's per-lookup work was compiled (engine/cache/lru_core.py): a reference the compiled policy
must equal plan for plan, under every admission rule, CPU share, prefetch and warm start."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import islice

from moechat.engine.cache.policy import CachePolicyError, MissSplit, Plan

N_CLASS = 8
CRF_HALF_LIFE = 128.0
_DECAY = [2.0 ** (-dt / CRF_HALF_LIFE) for dt in range(8192)]
_INV_POW2 = [2.0**-c for c in range(N_CLASS)]
SECOND_USE_WINDOW = 256
UPLOAD_CAP = 1
PROTECT_RATIO = 1.0


class Admission:
    """Which misses a full group admits to its slots (ClassLRU's rule: all); the refused run on the CPU.

    `admit` filters the misses before victims are chosen, `pair` the (miss, victim) pairs after.
    """

    name = "classlru"
    tracks_recent = False  # whether `admit` reads the experts used within SECOND_USE_WINDOW tokens

    def admit(
        self, lru: ClassLRU, base: int, misses: list[int], n_tokens: int, recent: set[int]
    ) -> tuple[list[int], list[int]]:
        """(admitted, refused) among the misses."""
        return misses, []

    def pair(
        self, lru: ClassLRU, base: int, misses: list[int], victims: list[int]
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """((miss, victim slot) pairs to upload, misses refused) from the admitted misses in expert order."""
        return list(zip(misses, victims, strict=True)), []


class SecondUse(Admission):
    """Admit only an expert the layer used within the last SECOND_USE_WINDOW tokens: one-off uses stay out."""

    name = "second-use"
    tracks_recent = True

    def admit(
        self, lru: ClassLRU, base: int, misses: list[int], n_tokens: int, recent: set[int]
    ) -> tuple[list[int], list[int]]:
        return [e for e in misses if e in recent], [e for e in misses if e not in recent]


class UploadCap(Admission):
    """At most UPLOAD_CAP uploads per token of a lookup: the most used misses are uploaded."""

    name = "upload-cap"

    def admit(
        self, lru: ClassLRU, base: int, misses: list[int], n_tokens: int, recent: set[int]
    ) -> tuple[list[int], list[int]]:
        cap = UPLOAD_CAP * n_tokens
        if len(misses) <= cap:
            return misses, []
        ranked = sorted(misses, key=lambda e: (-lru.crf[base + e], e))
        return ranked[:cap], ranked[cap:]


class Protect(Admission):
    """Admit a miss only if its CRF is at least PROTECT_RATIO times its victim's (decayed) CRF."""

    name = "protect"

    def pair(
        self, lru: ClassLRU, base: int, misses: list[int], victims: list[int]
    ) -> tuple[list[tuple[int, int]], list[int]]:
        # The most used misses meet the best victims first; a miss less used than its victim's
        # expert leaves that expert in its slot.
        ranked = sorted(misses, key=lambda e: (-lru.crf[base + e], e))
        kept, refused = [], []
        for e, s in zip(ranked, victims, strict=True):
            if lru.crf[base + e] >= PROTECT_RATIO * lru._decayed(lru.key_of[s]):
                kept.append((e, s))
            else:
                refused.append(e)
        return sorted(kept), refused


ADMISSIONS: dict[str, Admission] = {a.name: a for a in (Admission(), SecondUse(), UploadCap(), Protect())}
POLICIES = tuple(ADMISSIONS)


class ClassLRU:
    """The slots of one group of layers with the same expert geometry; `admission` names the rule by which
    a full group admits misses (ADMISSIONS)."""

    def __init__(self, layers: Sequence[int], n_expert: int, n_slots: int, admission: str = "classlru") -> None:
        if n_slots <= 0:
            raise ValueError(f"a cache needs at least one slot, got {n_slots}")
        if admission not in POLICIES:
            raise ValueError(f"unknown cache policy '{admission}' (choose from {', '.join(POLICIES)})")
        self.admission = admission
        self._admission = ADMISSIONS[admission]
        self.layers = tuple(layers)
        self.n_expert = n_expert
        self.n_slots = n_slots
        self.slot_map: dict[int, list[int]] = {il: [-1] * n_expert for il in self.layers}  # -1: not cached
        self.key_of = [-1] * n_slots  # (layer, expert) key in each slot, -1 if empty
        # One LRU list per class, least recent first; all slots start empty in class 0, in slot order.
        # Empty slots therefore always sit at the front of class 0 until the group is full.
        self.lists: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(N_CLASS)]
        self.lists[0].update(dict.fromkeys(range(n_slots)))
        self.list_of = [0] * n_slots
        self.n_filled = 0
        n_keys = (max(self.layers) + 1) * n_expert if self.layers else 0
        self.crf = [0.0] * n_keys  # CRF at the key's last use; 0: never used
        self.last_use = [0] * n_keys  # layer clock at the key's last use
        self.clock = [0] * (max(self.layers) + 1 if self.layers else 0)
        self.prefetched: set[int] = set()  # slots a prefetch filled whose expert has not been used since

    @property
    def full(self) -> bool:
        return self.n_filled == self.n_slots

    def key(self, layer: int, expert: int) -> int:
        return layer * self.n_expert + expert

    def slot_of(self, layer: int, expert: int) -> int:
        return self.slot_map[layer][expert]

    def preload(self, picks: Sequence[tuple[int, int, float]]) -> list[tuple[int, int, int]]:
        """Warm start: put (layer, expert, CRF) into empty slots, in order, before any lookup.

        Each takes the CRF it had when saved, as of clock 0; returns (layer, expert, slot) placed.
        """
        placed = []
        for layer, e, c in picks:
            if self.n_filled == self.n_slots or self.slot_map[layer][e] >= 0:
                continue
            s = next(s for s in self.lists[0] if self.key_of[s] < 0)  # empty slots lead class 0
            key = self.key(layer, e)
            self.crf[key], self.last_use[key] = c, self.clock[layer]
            self._place(layer, e, s)
            placed.append((layer, e, s))
        return placed

    def decayed_crf(self, layer: int) -> list[float]:
        """Each expert's CRF of `layer` decayed to the layer's clock now (0: never used)."""
        base, now = layer * self.n_expert, self.clock[layer]
        return [self.crf[base + e] * 2.0 ** ((self.last_use[base + e] - now) / CRF_HALF_LIFE)
                for e in range(self.n_expert)]  # fmt: skip

    def _place(self, layer: int, e: int, s: int) -> tuple[int, int] | None:
        """Put expert e of `layer` into slot s, in the class list of its CRF; returns the (layer,
        expert) it evicts, if any. Misses, prefetches and the warm start all fill slots this way."""
        old = self.key_of[s]
        self.prefetched.discard(s)  # a prefetched expert evicted unused: a wasted upload
        evicted = None
        if old >= 0:
            evicted = divmod(old, self.n_expert)
            self.slot_map[evicted[0]][evicted[1]] = -1
        else:
            self.n_filled += 1
        key = self.key(layer, e)
        self.key_of[s], self.slot_map[layer][e] = key, s
        c = self.crf[key]
        cls = _class(c) if c >= 1 else 0  # never used (a prefetch): the lowest class
        del self.lists[self.list_of[s]][s]
        self.lists[cls][s] = None
        self.list_of[s] = cls
        return evicted

    def _decayed(self, key: int) -> float:
        """A key's CRF decayed to its layer's clock now."""
        dt = self.clock[key // self.n_expert] - self.last_use[key]
        return self.crf[key] * (_DECAY[dt] if dt < 8192 else 2.0 ** (-dt / CRF_HALF_LIFE))

    def _victims(self, m: int, selected: set[int]) -> list[int]:
        """The slots that m misses take, in order: empty slots first, then one eviction per miss.

        Each eviction takes, among the first slot of each class list that the lookup does not
        use, the one with the largest age / 2^class. A slot just filled holds a selected expert,
        so later picks of the same lookup skip it: the first m usable slots of each list are all
        the candidates there can be, found in one pass.
        """
        lists = self.lists
        victims = list(islice(lists[0], min(m, self.n_slots - self.n_filled)))  # empties lead class 0
        need = m - len(victims)
        if not need:
            return victims
        key_of, n_expert, clock, last_use = self.key_of, self.n_expert, self.clock, self.last_use
        scores, slots = [-2.0] * N_CLASS, [-1] * N_CLASS  # each class list's candidate; -2: none
        for c in range(N_CLASS):
            if lists[c]:
                for s in lists[c]:
                    key = key_of[s]
                    if key >= 0 and key not in selected:
                        scores[c] = (clock[key // n_expert] - last_use[key]) * _INV_POW2[c]
                        slots[c] = s
                        break
        taken: set[int] = set()
        for n in range(need):
            best, best_score = -1, -1.0
            for c in range(N_CLASS):
                if scores[c] > best_score:
                    best, best_score = c, scores[c]
            if best < 0:
                raise CachePolicyError("no slot can be evicted")
            victims.append(slots[best])
            if n + 1 == need:
                break
            # The lists do not change until every victim is chosen: the next candidate of the list
            # just used is its first slot neither selected nor taken.
            taken.add(slots[best])
            scores[best] = -2.0
            for s in lists[best]:
                key = key_of[s]
                if key >= 0 and key not in selected and s not in taken:
                    scores[best] = (clock[key // n_expert] - last_use[key]) * _INV_POW2[best]
                    slots[best] = s
                    break
        return victims

    def plan(self, layer: int, ids: Sequence[int], n_tokens: int, share: MissSplit | None = None) -> Plan:
        """Give a slot to each expert that `ids` (n_tokens x experts used) selects in `layer`.

        `share.take(layer, n_misses)` says how many of the misses the CPU takes; it is asked
        only when the group is full. Advances the layer's clock by n_tokens.
        """
        uniq = list(dict.fromkeys(ids))  # distinct, in order of first selection
        if len(uniq) > self.n_slots:
            raise CachePolicyError(
                f"layer {layer}: the lookup selects {len(uniq)} distinct experts but the cache has {self.n_slots} slots"
            )
        slots = self.slot_map[layer]
        base = layer * self.n_expert
        crf, last_use, now = self.crf, self.last_use, self.clock[layer]
        lists, list_of = self.lists, self.list_of
        hits: list[int] = []
        misses: list[int] = []
        n_prefetched = 0
        recent: set[int] = set()  # experts the layer used within SECOND_USE_WINDOW tokens ("second-use")
        track = self._admission.tracks_recent
        for e in uniq:
            key = base + e
            c = crf[key]
            if c:
                dt = now - last_use[key]
                c = c * (_DECAY[dt] if dt < 8192 else 2.0 ** (-dt / CRF_HALF_LIFE)) + 1.0
                if track and dt <= SECOND_USE_WINDOW:
                    recent.add(e)
            else:
                c = 1.0
            crf[key] = c
            last_use[key] = now
            s = slots[e]
            if s >= 0:
                if s in self.prefetched:
                    self.prefetched.discard(s)
                    n_prefetched += 1
                cls = int(c).bit_length() - 1
                if cls >= N_CLASS:
                    cls = N_CLASS - 1
                frm = list_of[s]
                if frm == cls:
                    lists[cls].move_to_end(s)
                else:
                    del lists[frm][s]
                    lists[cls][s] = None
                    list_of[s] = cls
                hits.append(e)
            else:
                misses.append(e)
        cpu: list[int] = []
        if misses and share is not None and self.n_filled == self.n_slots:
            n_c = min(share.take(layer, len(misses)), len(misses))
            if n_c > 0:
                # The least used misses go to the CPU; one that keeps being used gains CRF and is cached.
                misses.sort(key=lambda e: (crf[base + e], e))
                cpu, misses = sorted(misses[:n_c]), misses[n_c:]
        uploads: list[tuple[int, int]] = []
        evicted: list[tuple[int, int]] = []
        pairs: list[tuple[int, int]] = []
        if misses:
            full = self.n_filled == self.n_slots
            refused: list[int] = []
            if full:
                misses, refused = self._admission.admit(self, base, misses, n_tokens, recent)
            misses.sort()
            victims = self._victims(len(misses), {base + e for e in uniq})  # victims skip what this lookup uses
            if full:
                pairs, kept_out = self._admission.pair(self, base, misses, victims)
                refused += kept_out
            else:
                pairs = list(zip(misses, victims, strict=True))
            if refused:
                cpu = sorted(cpu + refused)
            for e, s in pairs:
                gone = self._place(layer, e, s)
                if gone is not None:
                    evicted.append(gone)
                uploads.append((e, s))
        self.clock[layer] = now + n_tokens
        return Plan.of(hits, uploads, cpu, evicted, n_prefetched)

    def prefetch(self, layer: int, experts: Sequence[int], spare: tuple[int, Sequence[int]] | None = None,
                 ) -> tuple[tuple[int, int], ...]:  # fmt: skip
        """Put predicted experts of `layer` in slots ahead of its lookup: (expert, slot) to upload.

        No use is counted (CRF and clock stay): the lookup that follows counts the experts it
        selects. Victims are chosen as for misses, sparing the predicted experts and those of
        `spare` (layer, experts) that are in a slot; as many predicted as the other slots hold.
        """
        spared = set() if spare is None or spare[0] not in self.slot_map else {
            spare[0] * self.n_expert + e for e in spare[1]}  # fmt: skip
        spared = {k for k in spared if self.slot_map[k // self.n_expert][k % self.n_expert] >= 0}
        slots = self.slot_map[layer]
        predicted = list(dict.fromkeys(experts))[: self.n_slots - len(spared)]
        want = sorted(e for e in predicted if slots[e] < 0)
        if not want:
            return ()
        base = layer * self.n_expert
        uploads = []
        for e, s in zip(want, self._victims(len(want), {base + e for e in predicted} | spared), strict=True):
            self._place(layer, e, s)
            self.prefetched.add(s)
            uploads.append((e, s))
        return tuple(uploads)


def _class(crf: float) -> int:
    """floor(log2(crf)) for crf >= 1, capped at the last class."""
    return min(N_CLASS - 1, int(crf).bit_length() - 1)
