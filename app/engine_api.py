"""What the app needs of an engine: `ChatEngine`, the model's description and the messages.

The TUI talks only to `ChatEngine` (the engine process's proxy, `real_engine.RealEngine` in
line mode, or a scripted fake in UI tests). Nothing here loads torch or numba: the chat app's UI
process imports this module, the engine runs in its own process. Methods are called from one
worker thread at a time (the app runs one job at a time).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from moechat.engine.cache.stats import StatsSnapshot
from moechat.engine.events import Event, SamplingParams
from moechat.tuner.baselines import MinBound
from moechat.tuner.events import ConfirmEvent, SweepDone, SweepEvent
from moechat.tuner.recommend import TuneReport

logger = logging.getLogger(__name__)

Message = dict[str, str]  # {"role": ..., "content": ...}

# A base model continuing the plain format writes the user's next line itself: stop there.
PLAIN_STOPS = ("\nUser:", "\nuser:")


@dataclass(frozen=True)
class ModelInfo:
    name: str  # file name
    path: str
    sha256_head: str  # hash of the first 16 MiB and the size: identifies the file cheaply
    arch: str
    n_layers: int
    n_expert: int
    n_expert_used: int
    n_ctx: int
    device: str
    hardware: str
    template: str  # where the chat template came from
    template_note: str = ""  # why the model's own template is not used, if it is not
    cache_note: str = ""  # how --moe-cache-mib auto sized the cache, in words ("" where a size was given)


class ChatEngine(Protocol):
    info: ModelInfo

    def fit_messages(self, messages: Sequence[Message]) -> tuple[list[int], int, str]:
        """Prompt tokens for the conversation, dropping the oldest turns if needed.

        Returns (tokens, messages dropped, a note when the chat template failed and the plain
        format was used instead).
        """
        ...

    def chat_tokens(self, messages: Sequence[Message]) -> list[int]:
        """The conversation through the chat template as it is (`moechat run --chat`'s tokens for one
        message), nothing dropped; ValueError where the template fails on it."""
        ...

    def encode(self, text: str) -> list[int]:
        """A raw prompt's tokens (`moechat run --raw`'s)."""
        ...

    def reply(
        self, prompt: list[int], params: SamplingParams, max_tokens: int, stop: threading.Event
    ) -> Iterator[Event]: ...

    def snapshot(self) -> StatsSnapshot | None: ...

    def cache(self) -> tuple[float, float]:
        """(MiB, CPU share) of the expert cache now."""
        ...

    def set_cache(self, mib: float, share: float) -> None: ...

    def min_bound(self) -> MinBound | None:
        """MIN's hit rate (with bypass) at the current cache's size and the cache's own, on its recent lookups
        (a bounded window; the whole session while it is shorter); None: no cache or no lookup yet."""
        ...

    def sweep(self, stop: threading.Event, max_mib: float | None, tokens: int, fresh: bool = False,
              check: bool = False) -> Iterator[SweepEvent]:  # fmt: skip
        """The calibration sweep (runs kept from earlier sweeps are reused unless `fresh`). `check`: a
        noise check first; a NoiseCheck that is not steady ends the sweep (tuner.sweep.calibrate)."""
        ...

    def recommend(self, done: SweepDone) -> TuneReport: ...

    def confirm(self, stop: threading.Event, current: tuple[float, float],
                recommended: tuple[float, float]) -> Iterator[ConfirmEvent]:  # fmt: skip
        """The recommended (MiB, share) against the current one, measured alternately (tuner.confirm)."""
        ...

    def close(self) -> None: ...
