"""The cache's recent lookups, kept for the MIN bound the app shows after each reply.

MIN (the offline optimum) replays lookups knowing their future, so its cost grows with what it
replays. The log keeps a bounded window instead of the whole session: the lookups since a
checkpoint at least `window_tokens` tokens back (at most `window_tokens + every_tokens`), with
the experts the slots held at that checkpoint (MIN starts from them, as the cache did) and the
hits the cache itself had on those lookups, so that the bound and the hit rate beside it cover
the same lookups. While the session is shorter than the window, the window is the whole session,
from the warm-started slots.

The lookups lie in one int32 buffer, which the policy's compiled lookup appends to directly
(`lru_core.step`): buf[0] is where the next record goes; a record is layer, experts per token,
number of ids, the cache's hits (-1: the lookup went around the cache), then the ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

WINDOW_TOKENS = 2048  # tokens of the cache's first layer
EVERY_TOKENS = 256  # a checkpoint this often
HEAD = 1  # buf[0]: the end of the records
RECORD = 4  # a record's fields before its ids


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
    at: int  # offset of its first record, counted from the session's first
    slots: tuple[tuple[int, int], ...]


class LookupLog:
    def __init__(self, preload: Sequence[tuple[int, int]], per_token: int = 64, batch_tokens: int = 1,
                 window_tokens: int = WINDOW_TOKENS, every_tokens: int = EVERY_TOKENS) -> None:  # fmt: skip
        """`per_token`: the entries one token's lookups take at most (each cached layer: RECORD + its
        experts per token); `batch_tokens`: the most tokens one lookup logged may have. The buffer
        holds a whole window from the start, so the compiled lookup always finds room."""
        self.window_tokens = window_tokens
        self.every_tokens = every_tokens
        self.buf = np.zeros(HEAD + per_token * (window_tokens + 2 * every_tokens + batch_tokens), np.int32)
        self.buf[0] = HEAD
        self._checkpoints = [_Checkpoint(0, 0, tuple(preload))]
        self._dropped = 0  # entries dropped before the oldest checkpoint kept
        self.tokens = 0

    def add(self, layer: int, n_used: int, ids: Sequence[int] | np.ndarray, hits: int) -> None:
        """One lookup of the cache: its ids, and its hits (-1: it went around the cache)."""
        n = len(ids)
        end = int(self.buf[0])
        if end + RECORD + n > self.buf.size:
            self.buf = np.concatenate((self.buf, np.zeros(max(self.buf.size, RECORD + n), np.int32)))
        buf = self.buf
        buf[end : end + RECORD] = (layer, n_used, n, hits)
        buf[end + RECORD : end + RECORD + n] = ids
        buf[0] = end + RECORD + n

    def tick(self, n_tokens: int, slots: Callable[[], tuple[tuple[int, int], ...]]) -> None:
        """Before the first layer's lookup of `n_tokens` tokens: a checkpoint when one is due (with the
        slots' experts as they are), and the window's start moved past what it no longer needs."""
        if self.tokens // self.every_tokens != (self.tokens + n_tokens) // self.every_tokens:
            end = int(self.buf[0])
            self._checkpoints.append(_Checkpoint(self.tokens, self._dropped + end - HEAD, slots()))
            start = self._start()
            if start > 0:
                first = self._checkpoints[start]
                del self._checkpoints[:start]
                drop = first.at - self._dropped
                self.buf[HEAD : end - drop] = self.buf[HEAD + drop : end]  # numpy copies overlapping slices safely
                self.buf[0] = end - drop
                self._dropped = first.at
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
        buf = self.buf[: int(self.buf[0])].tolist()
        records = []
        hits = lookups = 0
        h = HEAD + first.at - self._dropped
        while h < len(buf):
            layer, n_used, n, hit = buf[h : h + RECORD]
            picked = tuple(buf[h + RECORD : h + RECORD + n])
            records.append((layer, n_used, picked))
            if hit >= 0:
                hits += hit
                lookups += len(set(picked))
            h += RECORD + n
        return LookupWindow(tuple(records), first.slots, hits, lookups, self.tokens - first.token,
                            first.token == 0 and self._dropped == 0)  # fmt: skip
