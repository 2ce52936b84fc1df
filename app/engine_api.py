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
from typing import Protocol, runtime_checkable

from moechat.engine.cache.stats import StatsSnapshot
from moechat.engine.events import BatchStatus, Event, SamplingParams
from moechat.tuner.baselines import MinBound
from moechat.tuner.events import ConfirmEvent, SweepDone, SweepEvent
from moechat.tuner.recommend import TuneReport

logger = logging.getLogger(__name__)

Message = dict[str, str]  # {"role": ..., "content": ...}

# A base model continuing the plain format writes the user's next line itself: stop there.
PLAIN_STOPS = ("\nUser:", "\nuser:")


# The engine's errors by kind: what crosses the engine process's pipe (the kind and one line), and the HTTP
# status a server answers each with. An exception crosses as the nearest class in its ancestry named here;
# a test holds every exception class of the engine, the tuner and the engine process's modules to a row.
ENGINE_ERRORS: dict[str, int] = {
    # The request or the settings: 400.
    "ValueError": 400,
    "ParameterError": 400,
    "CacheError": 400,
    "SettingError": 400,
    "ChatTemplateError": 400,  # the model's template fails on these messages
    "ContextFull": 400,
    "ContextTooLarge": 400,
    "TokenizerError": 400,
    "TraceError": 400,
    "FitError": 400,  # the tuner's time model cannot be fitted to the runs
    # The model or the machine: 500.
    "GGUFError": 500,
    "DemoError": 500,
    "DemoSourceMissing": 500,
    "ReadError": 500,
    "RamTierError": 500,
    "CachePolicyError": 500,
    "Stopped": 500,  # generation's own signal, never out of it
    "EngineProcessError": 500,
    "internal": 500,  # any other exception
    # A split model's rank went away: the server cannot answer until it is restarted.
    "RankLost": 503,
    # The caller stopped a tuning run.
    "Cancelled": 499,
}


def error_kind(e: BaseException) -> str:
    """The row of ENGINE_ERRORS an exception crosses the pipe as."""
    return next((c.__name__ for c in type(e).__mro__ if c.__name__ in ENGINE_ERRORS), "internal")


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
    """What every engine serves: a chat and its numbers (the app's chat and dashboard, also attached to a
    server's engine by `moechat attach`)."""

    info: ModelInfo

    def fit_messages(self, messages: Sequence[Message]) -> tuple[list[int], int, str]:
        """Prompt tokens for the conversation, dropping the oldest turns if needed.

        Returns (tokens, messages dropped, a note when the chat template failed and the plain
        format was used instead).
        """
        ...

    def reply(
        self, prompt: list[int], params: SamplingParams, max_tokens: int, stop: threading.Event,
        stops: Sequence[str] = (),
    ) -> Iterator[Event]:  # fmt: skip
        """The reply's events. `stops`: strings the reply ends at, cut from its text once, here (with the plain
        format's own): the DoneEvent then says "eos"."""
        ...

    def snapshot(self) -> StatsSnapshot | None: ...

    def cache(self) -> tuple[float, float]:
        """(MiB, CPU share) of the expert cache now."""
        ...

    def min_bound(self) -> MinBound | None:
        """MIN's hit rate (with bypass) at the current cache's size and the cache's own, on its recent lookups
        (a bounded window; the whole session while it is shorter); None: no cache or no lookup yet."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class LocalEngine(ChatEngine, Protocol):
    """An engine whose model runs on this machine (in-process or in the engine process): tokens in, the
    cache's settings and the tuning wizard's runs (`moechat run`, the chat app, the server's jobs)."""

    def chat_tokens(self, messages: Sequence[Message]) -> list[int]:
        """The conversation through the chat template as it is (`moechat run --chat`'s tokens for one
        message), nothing dropped; ValueError where the template fails on it."""
        ...

    def encode(self, text: str) -> list[int]:
        """A raw prompt's tokens (`moechat run --raw`'s)."""
        ...

    def set_cache(self, mib: float, share: float) -> None: ...

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


class ServingEngine(LocalEngine, Protocol):
    """A server's engine: requests on KV slots, decoded together (`moechat serve --parallel N`)."""

    def batch_status(self) -> BatchStatus | None:
        """What its batcher does now: slots, active and queued requests, the last step's tokens, per-slot t/s."""
        ...


NOT_LOCAL = "runs on the server's machine: start `moechat tune` there (an attached app only watches and chats)"


def local(engine: ChatEngine, what: str) -> LocalEngine:
    """The engine as one whose model runs here, or ValueError saying where `what` (tuning, ...) runs."""
    if not isinstance(engine, LocalEngine):
        raise ValueError(f"{what} {NOT_LOCAL}")
    return engine
