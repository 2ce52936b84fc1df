"""Messages from the engine worker thread to the UI. Payloads are frozen; stats updates coalesce."""

from __future__ import annotations

from moechat.engine.cache.stats import StatsSnapshot
from moechat.engine.events import BatchStatus, DoneEvent
from moechat.tuner.baselines import MinBound
from moechat.tuner.events import ConfirmEvent, SweepEvent
from moechat.tuner.recommend import TuneReport
from textual.message import Message


class TokenText(Message):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class StatsUpdate(Message):
    """The latest numbers; a newer one waiting in the queue replaces an older one."""

    def __init__(self, snapshot: StatsSnapshot | None, tokens: int, tps: float, upload_mib_per_token: float,
                 final: bool = False, full: bool = True, batch: BatchStatus | None = None) -> None:  # fmt: skip
        super().__init__()
        self.snapshot, self.tokens, self.tps, self.upload_mib_per_token = snapshot, tokens, tps, upload_mib_per_token
        self.final = final  # the last update of a reply
        self.full = full  # the dashboard's costly views redraw (the publisher's Cadence says when)
        self.batch = batch  # an attached server's slots and decode steps

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsUpdate)


class ReplyDone(Message):
    def __init__(self, done: DoneEvent, ttft: float) -> None:
        super().__init__()
        self.done, self.ttft = done, ttft


class ReplyFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class ContextTrimmed(Message):
    """The prompt was adapted: oldest turns left out, or the chat template replaced (note says why)."""

    def __init__(self, dropped: int, note: str = "") -> None:
        super().__init__()
        self.dropped, self.note = dropped, note


class SweepUpdate(Message):
    def __init__(self, event: SweepEvent) -> None:
        super().__init__()
        self.event = event


class TuneReady(Message):
    def __init__(self, report: TuneReport) -> None:
        super().__init__()
        self.report = report


class ConfirmUpdate(Message):
    """A confirm run's progress, or (ConfirmDone) its verdict."""

    def __init__(self, event: ConfirmEvent) -> None:
        super().__init__()
        self.event = event


class SweepFailed(Message):
    def __init__(self, error: str, cancelled: bool) -> None:
        super().__init__()
        self.error, self.cancelled = error, cancelled


class CacheApplied(Message):
    def __init__(self, mib: float, share: float, error: str | None) -> None:
        super().__init__()
        self.mib, self.share, self.error = mib, share, error


class BoundUpdate(Message):
    """After a reply: MIN's hit rate and the cache's on its recent lookups (None: no cache)."""

    def __init__(self, bound: MinBound | None) -> None:
        super().__init__()
        self.bound = bound
