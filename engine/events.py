"""What generation takes and yields, without torch: sampling parameters and the event stream.

The chat app's UI process reads these (and nothing that loads torch or numba); the engine
process and `generate` make them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def validate(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top-k must be >= 0, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top-p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"min-p must be in [0, 1), got {self.min_p}"),
            (self.repeat_penalty > 0, f"repeat penalty must be > 0, got {self.repeat_penalty}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class TokenEvent:
    token: int
    text: str
    index: int  # 0-based index among generated tokens
    seconds: float = 0.0  # since the previous token (the first: since the prompt was read)


def tokens_per_second(n_tokens: int, seconds_since_first: float) -> float:
    """Decode speed, the one formula every display uses: the tokens after the first over the time
    since the first arrived (the first token's wait is the prompt's, counted apart)."""
    return (n_tokens - 1) / seconds_since_first if n_tokens > 1 and seconds_since_first > 0 else 0.0


@dataclass(frozen=True)
class DoneEvent:
    n_prompt: int  # prompt tokens read for this reply
    n_generated: int
    prompt_seconds: float  # reading the prompt, up to the first token's logits
    gen_seconds: float  # from the first generated token to the end
    stop_reason: str  # eos | length | context | stopped
    n_kept: int = 0  # prompt tokens the KV cache held already (from earlier replies), not read again

    @property
    def context(self) -> int:
        """Positions of the context in use at the end: the kept and read prompt, and the reply."""
        return self.n_kept + self.n_prompt + self.n_generated

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return tokens_per_second(self.n_generated, self.gen_seconds)


Event = TokenEvent | DoneEvent


@dataclass(frozen=True)
class BatchStatus:
    """What a server's batcher is doing (`engine.serving.batcher`), for a dashboard and /metrics: its slots, how
    many hold a request (reading its prompt or decoding), how many requests wait for a slot, the tokens of the
    last decode step, the steps so far and each slot's tokens/s (0: idle, or reading its prompt)."""

    slots: int
    active: int
    queued: int
    last_batch: int
    steps: int
    slot_tps: tuple[float, ...] = ()
