"""One reply from the engine to the screen, run on a worker thread: it never touches a widget.

It posts frozen messages: the text in pieces, stats snapshots, the end of the reply. Text and
stats leave together at the cadence of `refresh_ms`, so the screen draws them in one pass (each
pass relays out the screen, the UI's main cost while streaming); the dashboard's costly views
redraw with one update a second (`FULL_EVERY`) and with the last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from moechat.app.cadence import Cadence
from moechat.app.engine_api import ChatEngine
from moechat.app.engine_api import Message as ChatMessage
from moechat.app.messages import ContextTrimmed, ReplyDone, StatsUpdate, TokenText
from moechat.engine.cache.stats import StatsSnapshot
from moechat.engine.events import BatchStatus, DoneEvent, SamplingParams, TokenEvent, tokens_per_second
from textual.message import Message

FULL_EVERY = 1.0  # seconds: the throughput plot and the heat map redraw at most once a second


def stream_reply(engine: ChatEngine, messages: list[ChatMessage], params: SamplingParams, n_predict: int,
                 stop: threading.Event, every: float, post: Callable[[Message], object]) -> None:  # fmt: skip
    """Generate a reply to `messages`, posting what the screen shows; engine errors propagate."""
    prompt, dropped, note = engine.fit_messages(messages)
    if dropped or note:
        post(ContextTrimmed(dropped, note))
    cadence = Cadence(every, FULL_EVERY)
    t0 = time.perf_counter()
    first = 0.0
    n = 0
    pending = ""  # text not yet posted
    try:
        for ev in engine.reply(prompt, params, n_predict, stop):
            if isinstance(ev, TokenEvent):
                if ev.token >= 0:
                    n += 1
                    if n == 1:
                        first = time.perf_counter()
                pending += ev.text
                send, full = cadence.due()
                if send:
                    if pending:
                        post(TokenText(pending))
                        pending = ""
                    post(_stats(engine, n, first, full))
            elif isinstance(ev, DoneEvent):
                if pending:
                    post(TokenText(pending))
                    pending = ""
                post(_stats(engine, n, first, True, final=True, tps=ev.gen_tps))  # the status line's figure
                post(ReplyDone(ev, (first or time.perf_counter()) - t0))
    finally:
        if pending:  # the engine failed: what it wrote so far still reaches the screen and the save
            post(TokenText(pending))


def _stats(engine: ChatEngine, n: int, first: float, full: bool, final: bool = False,
           tps: float | None = None) -> StatsUpdate:  # fmt: skip
    if tps is None:  # while streaming: the engine's formula over what this side has seen
        tps = tokens_per_second(n, time.perf_counter() - first if first else 0.0)
    return stats_update(engine.snapshot(), n, tps, full, final)


def stats_update(snap: StatsSnapshot | None, n: int, tps: float, full: bool, final: bool = False,
                 batch: BatchStatus | None = None) -> StatsUpdate:  # fmt: skip
    """What the dashboard draws: the snapshot, the reply's tokens and t/s, the MiB uploaded per token; an attached
    server's slots and decode steps (`batch`)."""
    up = snap.total.uploaded_bytes / 2**20 / max(snap.tokens, 1) if snap is not None else 0.0
    return StatsUpdate(snap, n, tps, up, final, full, batch)
