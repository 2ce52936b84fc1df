"""The KV slots of a server: one bank of caches, each slot keeping the conversation it last served.

A request takes the free slot whose tokens share the longest prefix with its prompt, where the prompt goes on
from that slot's last one or shares at least half of itself with it (else the least recently used slot), so
two conversations served in turn each find their own prefix again, and the same prompt asked again starts
from the logits kept after it (`PromptCache`: the reply is the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..nn.layers import KVBank, KVCache
from ..prompt_cache import PromptCache, common_prefix

SIMILAR = 0.5  # a slot's prefix worth keeping a prompt on: this share of the prompt (llama-server's default)


class Slots:
    def __init__(self, bank: KVBank, *, can_roll_back: bool) -> None:
        self.bank = bank
        self.n = bank.n_slots
        self.n_ctx = bank.n_ctx
        self._caches = bank.caches()
        self._prompts = [PromptCache(self._fresh(s), can_roll_back=can_roll_back) for s in range(self.n)]
        self._free = [True] * self.n
        self._used = [0] * self.n  # when each slot was last taken (a counter)
        self._asked = [0] * self.n  # the length of the prompt each slot last served
        self._clock = 0

    def _fresh(self, s: int) -> Callable[[], KVCache]:
        """The slot's cache emptied (what PromptCache makes when it starts over)."""
        cache = self._caches[s]

        def make() -> KVCache:
            for layer in cache.layers:  # a recurrent layer's state starts from zero again
                if layer.conv is not None:
                    layer.conv.zero_()
                if layer.state is not None:
                    layer.state.zero_()
            cache.pos = 0
            return cache

        return make

    def take(self, prompt: Sequence[int]) -> int | None:
        """The free slot for `prompt`, now busy (None: none is free): the one sharing the longest prefix with it
        where the prompt extends that slot's last prompt (a conversation's next turn) or shares at least SIMILAR
        of itself with it; else the least recently used (an empty one first), emptied: a conversation's slot is
        not given to another that shares only the chat template's opening, and a new conversation is read whole,
        as alone on a fresh server (the same chunks, the same bits)."""
        free = [s for s in range(self.n) if self._free[s]]
        if not free:
            return None
        shared = {s: common_prefix(self._prompts[s].tokens, prompt) for s in free}
        best = max(free, key=lambda s: (shared[s], -self._used[s]))
        goes_on = 0 < self._asked[best] <= shared[best]  # it extends the slot's last prompt (a conversation's turn)
        if not goes_on and shared[best] < SIMILAR * len(prompt):  # another conversation: read from the start
            best = min(free, key=lambda s: self._used[s])
            self._prompts[best].clear()
        self._free[best] = False
        self._clock += 1
        self._used[best] = self._clock
        self._asked[best] = len(prompt)
        return best

    def held(self, s: int) -> Sequence[int]:
        """The tokens slot s holds."""
        return self._prompts[s].tokens

    def resume(self, s: int, prompt: Sequence[int]) -> tuple[KVCache, int, torch.Tensor | None]:
        """Slot s positioned after the part of `prompt` it holds (`PromptCache.resume`)."""
        return self._prompts[s].resume(prompt)

    def read(self, s: int, prompt: Sequence[int], logits: torch.Tensor) -> None:
        """The whole prompt is read: the logits after it are kept for the same prompt asked again."""
        self._prompts[s].record(prompt, (len(prompt), logits))

    def give_back(self, s: int, tokens: Sequence[int]) -> None:
        """The request on slot s ended having fed `tokens` (prompt and reply): kept for the next one."""
        self._prompts[s].record(tokens)
        self._free[s] = True

    def clear(self) -> None:
        """Every slot empty and free."""
        for p in self._prompts:
            p.clear()
        self._free = [True] * self.n
        self._asked = [0] * self.n
