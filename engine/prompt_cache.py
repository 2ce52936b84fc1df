"""A KV cache kept across prompts: a prompt that starts as the last one did reads only what differs.

A chat renders the whole conversation for every turn. Without this each turn would prefill it
all again, so the wait for the first token would grow with the chat. Here the cache remembers
the tokens it holds; the next prompt resumes after their longest common prefix with it: a new
turn reads only what was appended, a regenerated or edited turn rolls back to where it differs.

Attention layers roll back by position (what lies beyond is overwritten). A recurrent layer
(linear attention) holds one state for everything it has read and cannot roll back: a model
with such layers resumes only when the prompt extends all that the cache holds, and starts over
otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .nn.layers import KVCache


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PromptCache:
    def __init__(self, make: Callable[[], KVCache], *, can_roll_back: bool) -> None:
        self._make = make
        self.can_roll_back = can_roll_back
        self.kv: KVCache | None = None
        self.tokens: list[int] = []  # what the cache holds, position by position

    def resume(self, prompt: Sequence[int]) -> tuple[KVCache, int]:
        """The cache, positioned after the part of `prompt` it already holds, and that part's length.

        The prompt's last token is always read again: its logits are where the reply starts.
        """
        held = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        if self.kv is None or held <= 0 or (held < self.kv.pos and not self.can_roll_back):
            self.kv, self.tokens, held = self._make(), [], 0
        else:
            self.kv.pos = held
            del self.tokens[held:]
        return self.kv, held

    def record(self, tokens: Sequence[int]) -> None:
        """What was fed after `resume`: the whole prompt and the reply; the cache keeps what it read of them."""
        if self.kv is not None:
            self.tokens = list(tokens[: self.kv.pos])

    def clear(self) -> None:
        self.kv, self.tokens = None, []
