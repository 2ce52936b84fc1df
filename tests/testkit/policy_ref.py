"""A slow, literal reading of the ClassLRU rules, to check the engine's fast policy against.

Plain lists, linear scans, no shortcuts: each rule of docs/design.md in the most obvious form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

N_CLASS = 8


class RefClassLRU:
    def __init__(self, layers: Sequence[int], n_expert: int, n_slots: int) -> None:
        self.n_expert, self.n_slots = n_expert, n_slots
        self.owner: list[tuple[int, int] | None] = [None] * n_slots
        self.order: list[list[int]] = [list(range(n_slots))] + [[] for _ in range(N_CLASS - 1)]
        self.crf: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], int] = {}
        self.clock = dict.fromkeys(layers, 0)

    def _class(self, key: tuple[int, int]) -> int:
        c = 0
        while c < N_CLASS - 1 and self.crf[key] >= 2.0 ** (c + 1):
            c += 1
        return c

    def _to_tail(self, s: int, c: int) -> None:
        for lst in self.order:
            if s in lst:
                lst.remove(s)
        self.order[c].append(s)

    def plan(
        self, layer: int, ids: Sequence[int], n_tokens: int, n_cpu: Callable[[int], int] | None = None
    ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]:
        uniq = list(dict.fromkeys(ids))
        now = self.clock[layer]
        hits, misses = [], []
        for e in uniq:
            key = (layer, e)
            old = self.crf.get(key, 0.0)
            self.crf[key] = old * 2.0 ** ((self.last.get(key, now) - now) / 128.0) + 1.0
            self.last[key] = now
            if key in self.owner:
                self._to_tail(self.owner.index(key), self._class(key))
                hits.append(e)
            else:
                misses.append(e)
        cpu: list[int] = []
        if misses and n_cpu is not None and None not in self.owner:
            n = min(n_cpu(len(misses)), len(misses))
            ranked = sorted(misses, key=lambda e: (self.crf[(layer, e)], e))
            cpu = sorted(ranked[:n])
            misses = [e for e in misses if e not in cpu]
        uploads = []
        for e in sorted(misses):
            victim = None
            if None in self.owner:
                victim = self.order[0][0]
            else:
                best = -1.0
                for c, lst in enumerate(self.order):
                    cands = [s for s in lst if self.owner[s] is None or self.owner[s] not in {(layer, u) for u in uniq}]
                    if cands:
                        k = self.owner[cands[0]]
                        assert k is not None
                        score = (self.clock[k[0]] - self.last[k]) / 2.0**c
                        if score > best:
                            victim, best = cands[0], score
            assert victim is not None
            self.owner[victim] = (layer, e)
            self._to_tail(victim, self._class((layer, e)))
            uploads.append((e, victim))
        self.clock[layer] += n_tokens
        return tuple(hits), tuple(uploads), tuple(cpu)
