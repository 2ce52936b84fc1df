"""Requests on the engine, up to `parallel` at once (its KV slots, decoded together), in arrival order, from a
bounded queue.

Each request becomes a job on a worker thread (one per slot); the job streams its pieces to the request's
asyncio queue. Beyond `max_waiting` queued requests a new one is refused at once (429 with Retry-After),
never left to hang. A stop event per job ends its generation between two tokens: a streaming client that
goes away sets it, and its slot serves the next request at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from moechat.app.engine_api import LocalEngine
from moechat.app.engine_process import EngineProcessError
from moechat.app.serve.wire import ApiError, Request
from moechat.engine.events import DoneEvent, TokenEvent, tokens_per_second

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the conversation's KV cache held from an earlier request


class Jobs:
    def __init__(self, engine: LocalEngine, n_ctx: int, max_waiting: int, parallel: int = 1) -> None:
        self.engine = engine
        self.n_ctx = n_ctx
        self.max_waiting = max_waiting
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="moechat-serve-engine")
        self._lock = threading.Lock()
        self.waiting = 0  # accepted, not yet on the engine
        self.running = 0
        # Totals for /metrics.
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cancelled = 0
        # The reply on the engine now, or the last: its tokens and t/s (what an attached dashboard shows).
        self.live_tokens = 0
        self.live_tps = 0.0

    def admit(self) -> None:
        """Take a request into the queue, or refuse it (429) when the queue is full."""
        with self._lock:
            if self.waiting >= self.max_waiting:
                raise ApiError(429, f"the server is busy: {self.waiting} requests wait for the engine; try again "
                                    "shortly", kind="rate_limit_error", code="queue_full")  # fmt: skip
            self.waiting += 1

    def run(self, req: Request, stop: threading.Event, out: asyncio.Queue[Any]) -> asyncio.Future[None]:
        """Queue the job (admitted before); its pieces, a Finished or an ApiError arrive in `out`."""
        loop = asyncio.get_running_loop()

        def put(item: object) -> None:
            loop.call_soon_threadsafe(out.put_nowait, item)

        def work() -> None:
            with self._lock:
                self.waiting -= 1
                self.running += 1
            try:
                if stop.is_set():  # the client left while the job waited
                    with self._lock:
                        self.cancelled += 1
                    put(None)
                    return
                put(self._generate(req, stop, put))
            except ApiError as e:
                put(e)
            except ValueError as e:  # the engine's word on a bad input (a template that fails on it, ...)
                put(ApiError(400, str(e)))
            except EngineProcessError as e:  # its kind's status (engine_api.ENGINE_ERRORS)
                logger.error("a request failed on the engine: %s", e)
                put(ApiError(e.status, f"the engine failed: {e}", kind="server_error"))
            except Exception as e:
                logger.exception("a request failed on the engine")
                put(ApiError(500, f"the engine failed: {type(e).__name__}: {e}", kind="server_error"))
            finally:
                with self._lock:
                    self.running -= 1

        return loop.run_in_executor(self._pool, work)

    def _generate(self, req: Request, stop: threading.Event, put: Any) -> Finished:
        t0 = time.perf_counter()
        engine = self.engine
        tokens = engine.chat_tokens(req.messages) if req.messages is not None else engine.encode(req.prompt or "")
        if len(tokens) >= self.n_ctx:
            raise ApiError(400, f"the prompt is {len(tokens)} tokens, and the context holds {self.n_ctx}",
                           param="messages" if req.messages is not None else "prompt",
                           code="context_length_exceeded")  # fmt: skip
        room = self.n_ctx - len(tokens)
        max_tokens = min(req.max_tokens or room, room)
        first = 0.0
        finish, n_generated, cached = "length", 0, 0
        # The engine cuts the stop strings (and ends the reply at one: "eos").
        for ev in engine.reply(tokens, req.params, max_tokens, stop, req.stops):
            if isinstance(ev, TokenEvent):
                if ev.token >= 0 and not first:
                    first = time.perf_counter() - t0
                if ev.token >= 0:
                    self.live_tokens = ev.index + 1
                    self.live_tps = tokens_per_second(ev.index + 1, time.perf_counter() - t0 - first)
                if ev.text:
                    put(Piece(ev.text))
            elif isinstance(ev, DoneEvent):
                n_generated, cached = ev.n_generated, ev.n_kept
                if ev.stop_reason == "stopped":
                    with self._lock:
                        self.cancelled += 1
                finish = "stop" if ev.stop_reason in ("eos", "stopped") else "length"
        with self._lock:
            self.prompt_tokens += len(tokens)
            self.completion_tokens += n_generated
        return Finished(finish, len(tokens), n_generated, cached)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
