"""The engine in a child process: the UI process only draws, the model runs on its own main thread.

Why a process and not a thread: on a small machine the UI's rendering and the engine's Python
code share one GIL, and torch's intra-op threads run measurably slower when called from a worker
thread than from a main thread (bench/tui_overhead.py). A child process also keeps a crash in
native code from taking the UI down with it.

`ProcessEngine` is a `ChatEngine`: each call sends (name, args) over a pipe and reads the
answer; streaming calls (reply, sweep) read events until "end". Stop requests travel through a
shared Event that the child's generation loop checks before every token.

The UI gives the engine its cores. On a small machine the engine's kernels split every call over all
cores and wait for the last thread, so each frame the UI draws on one of them stalls the whole call:
10% of a core of drawing cost the engine 13-20% of its speed (bench/tui_overhead.py). Once the engine
runs, the UI's threads drop to `UI_NICE`, so they draw in the engine's idle gaps, and the engine's
thread governor counts the UI's CPU time as its own rather than giving a thread away for it. A
child inherits the priority of the thread that starts it, and an unprivileged process cannot raise
a priority again, so every engine starts from one thread kept at the original priority.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moechat.app.cadence import Cadence
from moechat.app.engine_api import ENGINE_ERRORS, Message, ModelInfo, error_kind
from moechat.app.settings import Settings, cache_settings, error_line
from moechat.engine.cache.stats import StatsSnapshot
from moechat.engine.events import BatchStatus, DoneEvent, Event, SamplingParams
from moechat.tuner.baselines import MinBound
from moechat.tuner.events import Cancelled, ConfirmEvent, SweepDone, SweepEvent
from moechat.tuner.recommend import TuneReport

if TYPE_CHECKING:
    from moechat.app.real_engine import RealEngine

logger = logging.getLogger(__name__)

STOP_POLL_S = 0.05  # how often a stream waiting for the child looks at its stop event
UI_NICE = 19  # the UI's threads once an engine runs: they take a core only where the engine leaves one idle
_starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moechat-engine-start")  # never lowered
_lowered = False


def _lower_ui_priority() -> None:
    """Drop every thread of this process but the engine starter to UI_NICE (once; threads started
    later inherit it from the thread that starts them). Where the system refuses, the UI stays as it is."""
    global _lowered
    if _lowered or not hasattr(os, "setpriority"):
        return
    _lowered = True
    starter = _starter.submit(threading.get_native_id).result()
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [threading.get_native_id()]
    for tid in tids:
        if tid != starter:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), UI_NICE))


@dataclass(frozen=True)
class EngineSpec:
    model: str | None  # None: the built-in demo
    settings: Settings  # resolved in the parent: the child reads the engine's settings from it
    warm_start_dir: str | None = None  # where each model's saved expert use counts live (None: start cold)
    # A server's engine: requests on this many KV slots, decoded together (0: one reply at a time, the chat app's)
    slots: int = 0


class EngineProcessError(RuntimeError):
    """The engine process failed or went away, or an engine call failed other than on its input: `status`
    is the HTTP status a server answers it with (engine_api.ENGINE_ERRORS)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


def _serve(conn: Connection, spec: EngineSpec, stop: Any) -> None:
    """The child: load the model, then answer calls until "close" or the pipe closes.

    Started by torchrun as rank 0 of a model split over hosts (the app's process has RANK and
    WORLD_SIZE, and this child inherits them), the child is rank 0: it joins the group, loads its
    own layers, and the other ranks (`moechat chat` started the same way on each host) serve theirs."""
    from moechat.app.demo_model import resolve_model_quiet
    from moechat.app.real_engine import RealEngine, load_for
    from moechat.app.tuned import identity_of
    from moechat.engine.distributed import launched

    def progress(text: str) -> None:
        conn.send(("progress", text))

    from moechat.engine.kernels.threads import yielding_to_us

    yielding_to_us(os.getppid())  # the UI draws at a lower priority, in the engine's gaps
    try:
        path = resolve_model_quiet(spec.model, progress)
        progress(f"loading {path.name}...")
        identity = identity_of(path)
        warm = Path(spec.warm_start_dir) / f"{identity}.json" if spec.warm_start_dir and identity else None
        base = cache_settings(spec.settings, warm)
        kept = replace(base, mib=0.0, cpu_share=0.0, trace=None)  # what a cache change keeps
        if launched() is not None:
            from moechat.app.split_run import run_split_rank

            run_split_rank(path, spec.settings, base, lambda pm, lm: _answer(conn, RealEngine(lm, kept, identity, pm),
                                                                              spec, stop), progress)  # fmt: skip
            return
        lm = load_for(path, spec.settings, base, progress, first_start=True)
        engine = RealEngine(lm, kept, identity)
    except Exception as e:
        with contextlib.suppress(OSError):  # (a split's end after the app closed its side)
            conn.send(("error", error_kind(e), error_line(e)))
        return
    try:
        (_answer_many if spec.slots else _answer)(conn, engine, spec, stop)
    finally:
        engine.close()


def _calls(engine: RealEngine) -> dict[str, Callable[..., Any]]:
    """The engine's calls answered at once with one result (the streaming ones are each loop's own)."""
    return {
        "fit_messages": engine.fit_messages, "chat_tokens": engine.chat_tokens, "encode": engine.encode,
        "snapshot": engine.snapshot, "cache": engine.cache, "set_cache": engine.set_cache,
        "recommend": engine.recommend, "min_bound": engine.min_bound, "batch_status": engine.batch_status,
    }  # fmt: skip


def _answer(conn: Connection, engine: RealEngine, spec: EngineSpec, stop: Any) -> None:
    """Say the engine is ready, then answer the parent's calls until "close" or the pipe closes."""
    conn.send(("ready", engine.info))
    calls = _calls(engine)
    while True:
        try:
            name, args = conn.recv()
        except EOFError:
            break
        if name == "close":
            break
        try:
            if name == "reply":
                prompt, params, max_tokens, stops = args
                # Snapshots ride along with the tokens (the parent cannot ask mid-stream) at the
                # screen's cadence, and the last one comes before the end of the reply.
                cadence = Cadence(spec.settings.refresh_ms / 1000)
                for ev in engine.reply(prompt, params, max_tokens, stop, stops):
                    if cadence.due(last=isinstance(ev, DoneEvent))[0]:
                        conn.send(("snap", engine.snapshot()))
                    conn.send(("event", ev))
                conn.send(("end", engine.info))  # a first start's fast model may have taken over: what it is now
            elif name in ("sweep", "confirm"):
                for sev in (engine.sweep if name == "sweep" else engine.confirm)(stop, *args):
                    conn.send(("event", sev))
                conn.send(("end", None))
            else:
                conn.send(("result", calls[name](*args)))
        except Exception as e:
            logger.debug("engine call %s failed:\n%s", name, traceback.format_exc())
            conn.send(("error", error_kind(e), error_line(e)))


def _answer_many(conn: Connection, engine: RealEngine, spec: EngineSpec, stop: Any) -> None:
    """A server's engine: requests arrive as ("submit", (id, prompt, params, max_tokens, stops)) and are decoded
    together on the batcher between other calls; each one's events go back as ("bevent", id, event), its end
    as ("bdone", id, info) and a failure as ("berror", id, kind, line). ("cancel", (id,)) stops one. Other
    calls are answered between two steps."""
    if engine.split is not None and spec.slots > 1:
        conn.send(("error", "ValueError", "--parallel above 1 needs the model in one process (not split over hosts)"))
        return
    conn.send(("ready", engine.info))
    batcher = engine.batcher(spec.slots)
    calls = _calls(engine)
    streams: dict[int, Any] = {}

    def emit_for(rid: int) -> Callable[[Event], None]:
        def emit(ev: Event) -> None:
            conn.send(("bevent", rid, ev))
            if isinstance(ev, DoneEvent):
                streams.pop(rid, None)
                conn.send(("bdone", rid, engine.info))

        return emit

    while True:
        if not batcher.busy:
            engine.between_requests()
        # Idle: wait for a call. Busy: take what has come, then step.
        while not batcher.busy or conn.poll(0):
            try:
                name, args = conn.recv()
            except EOFError:
                return
            if name == "close":
                return
            try:
                if name == "submit":
                    rid, prompt, params, max_tokens, stops = args
                    try:
                        streams[rid] = engine.submit(prompt, params, max_tokens, stops, emit_for(rid))
                    except Exception as e:
                        conn.send(("berror", rid, error_kind(e), error_line(e)))
                elif name == "cancel":
                    if args[0] in streams:
                        streams[args[0]].cancel()
                else:
                    conn.send(("result", calls[name](*args)))
            except Exception as e:
                logger.debug("engine call %s failed:\n%s", name, traceback.format_exc())
                conn.send(("error", error_kind(e), error_line(e)))
        try:
            batcher.step()
        except Exception as e:
            logger.error("a decode step failed:\n%s", traceback.format_exc())
            batcher.fail_all()
            for rid in list(streams):
                conn.send(("berror", rid, error_kind(e), error_line(e)))
            streams.clear()


class ProcessEngine:
    def __init__(self, spec: EngineSpec, progress: Callable[[str], None] = lambda text: None) -> None:
        _starter.submit(self._start, spec).result()  # from the thread that keeps the original priority
        self._lock = threading.Lock()
        self._snap: StatsSnapshot | None = None
        self.slots = spec.slots
        while True:
            msg = self._recv()
            if msg[0] == "progress":
                progress(msg[1])
            elif msg[0] == "ready":
                self.info: ModelInfo = msg[1]
                _lower_ui_priority()
                break
            else:
                self._proc.join(5)
                raise ValueError(msg[2])
        if self.slots:  # a server's engine: one reader sorts the child's messages by request (`_read_many`)
            self._send_lock = threading.Lock()
            self._answers: queue.Queue[tuple[Any, ...]] = queue.Queue()
            self._requests: dict[int, queue.Queue[tuple[Any, ...]]] = {}
            self._ids = itertools.count()
            threading.Thread(target=self._read_many, name="moechat-engine-reader", daemon=True).start()

    def _read_many(self) -> None:
        """A server's engine: the child's messages, each to the request it belongs to or to the one call waiting."""
        while True:
            try:
                msg = self._recv()
            except EngineProcessError as e:
                gone = ("error", "EngineProcessError", str(e))
                self._answers.put(gone)
                for q in list(self._requests.values()):
                    q.put(gone)
                return
            if msg[0] in ("bevent", "bdone", "berror"):
                waiting = self._requests.get(msg[1])
                if waiting is not None:
                    waiting.put(msg)
            else:
                self._answers.put(msg)

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _reply_many(self, prompt: list[int], params: SamplingParams, max_tokens: int, stop: threading.Event,
                    stops: Sequence[str]) -> Iterator[Event]:  # fmt: skip
        """`reply` on a server's engine: the request decodes beside the others; `stop` cancels it."""
        rid = next(self._ids)
        q: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._requests[rid] = q
        cancelled = False
        try:
            self._send(("submit", (rid, prompt, params, max_tokens, tuple(stops))))
            while True:
                try:
                    msg = q.get(timeout=STOP_POLL_S)
                except queue.Empty:
                    msg = None
                if stop.is_set() and not cancelled:
                    self._send(("cancel", (rid,)))
                    cancelled = True
                if msg is None:
                    continue
                if msg[0] == "bevent":
                    yield msg[2]
                elif msg[0] == "bdone":
                    self.info = msg[2]
                    return
                else:
                    self._raise(msg[-2], msg[-1])
        finally:
            self._requests.pop(rid, None)

    def _start(self, spec: EngineSpec) -> None:
        # multiprocessing hands its children sys.stderr's descriptor (the engine, and the resource
        # tracker the first Event starts); under Textual sys.stderr is a capture object whose
        # descriptor is -1, so the real streams stand in while both start.
        with contextlib.redirect_stdout(sys.__stdout__), contextlib.redirect_stderr(sys.__stderr__):
            ctx = mp.get_context("spawn")  # a fresh interpreter: no copied UI state, no forked threads
            self._conn, child = ctx.Pipe()
            self._stop = ctx.Event()
            self._proc = ctx.Process(target=_serve, args=(child, spec, self._stop), daemon=True, name="moechat-engine")
            self._proc.start()
            child.close()

    def _recv(self) -> tuple[Any, ...]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.exitcode
            raise EngineProcessError(f"the engine process ended unexpectedly (exit code {code}); see the log") from None

    @staticmethod
    def _raise(kind: str, message: str) -> None:
        """The child's error as this side raises it: its kind's row of ENGINE_ERRORS says how."""
        status = ENGINE_ERRORS.get(kind, 500)
        if kind == "Cancelled":
            raise Cancelled(message)
        if status == 400:  # the caller's input: ValueError, as the engine in-process raises it
            raise ValueError(message)
        raise EngineProcessError(f"{kind}: {message}", status)

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            return self._exchange(name, args)

    def _exchange(self, name: str, args: tuple[Any, ...]) -> Any:
        """One call and its answer over the pipe; the caller holds the lock."""
        if self.slots:
            self._send((name, args))
            msg = self._answers.get()
        else:
            self._conn.send((name, args))
            msg = self._recv()
        if msg[0] == "error":
            self._raise(msg[1], msg[2])
        return msg[1]

    def _stream(self, name: str, args: tuple[Any, ...], stop: threading.Event) -> Iterator[Any]:
        with self._lock:
            self._stop.clear()
            self._conn.send((name, args))
            while True:
                # A stop reaches the child at once, not with its next message: a sweep between two
                # runs or a replay sends nothing for seconds (the child checks before each token).
                while not stop.is_set() and not self._conn.poll(STOP_POLL_S):
                    pass
                if stop.is_set():
                    self._stop.set()
                msg = self._recv()
                if msg[0] == "event":
                    yield msg[1]
                elif msg[0] == "snap":
                    self._snap = msg[1]
                elif msg[0] == "end":
                    if isinstance(msg[1], ModelInfo):
                        self.info = msg[1]
                    return
                else:
                    self._raise(msg[1], msg[2])

    def fit_messages(self, messages: Sequence[Message]) -> tuple[list[int], int, str]:
        return self._call("fit_messages", list(messages))

    def chat_tokens(self, messages: Sequence[Message]) -> list[int]:
        return self._call("chat_tokens", list(messages))

    def encode(self, text: str) -> list[int]:
        return self._call("encode", text)

    def reply(
        self, prompt: list[int], params: SamplingParams, max_tokens: int, stop: threading.Event,
        stops: Sequence[str] = (),
    ) -> Iterator[Event]:  # fmt: skip
        if self.slots:
            return self._reply_many(prompt, params, max_tokens, stop, stops)
        return self._stream("reply", (prompt, params, max_tokens, tuple(stops)), stop)

    def snapshot(self) -> StatsSnapshot | None:
        """The engine's latest; while a stream or another call holds the pipe, the latest a stream carried
        (never waits for a reply to end: a server's /metrics asks while requests stream). A server's engine
        answers between two decode steps."""
        if not self._lock.acquire(blocking=bool(self.slots)):
            return self._snap
        try:
            self._snap = self._exchange("snapshot", ())
        finally:
            self._lock.release()
        return self._snap

    def cache(self) -> tuple[float, float]:
        return self._call("cache")

    def batch_status(self) -> BatchStatus | None:
        """A server's engine: what its batcher does now (None: not a server's engine)."""
        return self._call("batch_status") if self.slots else None

    def set_cache(self, mib: float, share: float) -> None:
        self._call("set_cache", mib, share)

    def min_bound(self) -> MinBound | None:
        return self._call("min_bound")

    def sweep(self, stop: threading.Event, max_mib: float | None, tokens: int, fresh: bool = False,
              check: bool = False) -> Iterator[SweepEvent]:  # fmt: skip
        return self._stream("sweep", (max_mib, tokens, fresh, check), stop)

    def recommend(self, done: SweepDone) -> TuneReport:
        return self._call("recommend", done)

    def confirm(self, stop: threading.Event, current: tuple[float, float],
                recommended: tuple[float, float]) -> Iterator[ConfirmEvent]:  # fmt: skip
        return self._stream("confirm", (current, recommended), stop)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                with self._lock:
                    (self._send if self.slots else self._conn.send)(("close", ()))
            except OSError:
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()
