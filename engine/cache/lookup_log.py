"""The cache's recent lookups, kept for the MIN bound the app shows after each reply.

MIN (the offline optimum) replays lookups knowing their future, so its cost grows with what it
replays. The log keeps a bounded window instead of the whole session: the lookups since a
checkpoint at least `window_tokens` tokens back (at most `window_tokens + every_tokens`), with
the experts the slots held at that checkpoint (MIN starts from them, as the cache did) and the
hits the cache itself had on those lookups, so that the bound and the hit rate beside it cover
the same lookups. While the session is shorter than the window, the window is the whole session,
from the warm-started slots.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

WINDOW_TOKENS = 2048  # tokens of the cache's first layer
EVERY_TOKENS = 256  # a checkpoint this often


@dataclass(frozen=True)
class LookupWindow:
    """The lookups of the window and what the cache did on them."""

    records: tuple[tuple[int, int, tuple[int, ...]], ...]  # (layer, experts per token, ids token-major)
    preload: tuple[tuple[int, int], ...]  # (layer, expert) in the slots at the window's start
    hits: int  # the cache's hits on the window's lookups that went through it
    lookups: int  # distinct experts those lookups selected
    tokens: int  # tokens the window covers
    from_start: bool  # the window is the whole session (from the warm start)


@dataclass
class _Checkpoint:
    token: int
    at: int  # index of its first lookup
    ids_at: int  # offset of that lookup's ids
    slots: tuple[tuple[int, int], ...]


class LookupLog:
    def __init__(self, preload: Sequence[tuple[int, int]], window_tokens: int = WINDOW_TOKENS,
                 every_tokens: int = EVERY_TOKENS) -> None:  # fmt: skip
        self.window_tokens = window_tokens
        self.every_tokens = every_tokens
        self._heads = array("i")  # per lookup: layer, experts per token, ids, the cache's hits (-1: bypassed)
        self._ids = array("h")  # 2 bytes an expert id
        self._checkpoints = [_Checkpoint(0, 0, 0, tuple(preload))]
        self._dropped = 0  # lookups dropped before the oldest checkpoint kept
        self._dropped_ids = 0
        self.tokens = 0

    def add(self, layer: int, n_used: int, ids: list[int], hits: int) -> None:
        """One lookup of the cache: its ids, and its hits (-1: it went around the cache)."""
        self._heads.extend((layer, n_used, len(ids), hits))
        self._ids.extend(ids)

    def tick(self, n_tokens: int, slots: Callable[[], tuple[tuple[int, int], ...]]) -> None:
        """Before the first layer's lookup of `n_tokens` tokens: a checkpoint when one is due (with the
        slots' experts as they are), and the window's start moved past what it no longer needs."""
        if self.tokens // self.every_tokens != (self.tokens + n_tokens) // self.every_tokens:
            at, ids_at = self._dropped + len(self._heads) // 4, self._dropped_ids + len(self._ids)
            self._checkpoints.append(_Checkpoint(self.tokens, at, ids_at, slots()))
            start = self._start()
            if start > 0:
                first = self._checkpoints[start]
                del self._checkpoints[:start]
                n_heads, n_ids = (first.at - self._dropped) * 4, first.ids_at - self._dropped_ids
                del self._heads[:n_heads]
                del self._ids[:n_ids]
                self._dropped, self._dropped_ids = first.at, first.ids_at
        self.tokens += n_tokens

    def _start(self) -> int:
        """The latest checkpoint at least window_tokens back (0: none, the session's start)."""
        start = 0
        for i, c in enumerate(self._checkpoints):
            if c.token <= self.tokens - self.window_tokens:
                start = i
        return start

    def window(self) -> LookupWindow:
        first = self._checkpoints[self._start()]
        heads, ids = self._heads, self._ids
        records = []
        hits = lookups = 0
        h, at = (first.at - self._dropped) * 4, first.ids_at - self._dropped_ids
        while h < len(heads):
            layer, n_used, n, hit = heads[h], heads[h + 1], heads[h + 2], heads[h + 3]
            picked = tuple(ids[at : at + n])
            records.append((layer, n_used, picked))
            if hit >= 0:
                hits += hit
                lookups += len(set(picked))
            h, at = h + 4, at + n
        return LookupWindow(tuple(records), first.slots, hits, lookups, self.tokens - first.token,
                            first.token == 0 and self._dropped == 0)  # fmt: skip
