"""A KV cache kept across prompts: a prompt that starts as the last one did reads only what differs.

A chat renders the whole conversation for every turn. Without this each turn would prefill it
all again, so the wait for the first token would grow with the chat. Here the cache remembers
the tokens it holds; the next prompt resumes after their longest common prefix with it: a new
turn reads only what was appended, a regenerated or edited turn rolls back to where it differs.

Attention layers roll back by position (what lies beyond is overwritten). A recurrent layer
(linear attention) holds one state for everything it has read and cannot roll back: a model
with such layers resumes only when the prompt extends all that the cache holds, and starts over
otherwise.

The logits after the last prompt are kept too: the same prompt asked again (a regenerated reply, a
repeated request) starts from them and reads nothing, so the same seed gives the same reply. Reading
its last token again would run it through the one-token path, whose last bits differ from the
prompt path's, and a sampled reply could part from the first one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

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
        self.after: tuple[int, torch.Tensor] | None = None  # the logits after the first n tokens held

    def resume(self, prompt: Sequence[int]) -> tuple[KVCache, int, torch.Tensor | None]:
        """The cache, positioned after the part of `prompt` it already holds, that part's length, and the
        logits to start the reply from where the cache kept them for this very prompt (else None).

        Without kept logits the prompt's last token is read again: its logits are where the reply starts.
        """
        shared = common_prefix(self.tokens, prompt)
        after = self.after
        if (self.kv is not None and after is not None and shared == len(prompt) == after[0] > 0
                and (self.can_roll_back or self.kv.pos == shared)):  # fmt: skip
            self.kv.pos = shared
            del self.tokens[shared:]
            return self.kv, shared, after[1]
        held = min(shared, len(prompt) - 1)
        if self.kv is None or held <= 0 or (held < self.kv.pos and not self.can_roll_back):
            self.kv, self.tokens, held = self._make(), [], 0
        else:
            self.kv.pos = held
            del self.tokens[held:]
        if self.after is not None and self.after[0] > held:
            self.after = None
        return self.kv, held, None

    def record(self, tokens: Sequence[int], after: tuple[int, torch.Tensor] | None = None) -> None:
        """What was fed after `resume`: the whole prompt and the reply; the cache keeps what it read of them.
        `after`: the prompt's length and the logits after it, kept for the same prompt asked again."""
        if self.kv is not None:
            self.tokens = list(tokens[: self.kv.pos])
            if after is not None and after[0] <= len(self.tokens):
                self.after = (after[0], after[1].detach().clone())

    def clear(self) -> None:
        self.kv, self.tokens, self.after = None, [], None
