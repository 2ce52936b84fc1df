"""Many sequences on one model: each decode step runs every active sequence's token together.

A request (`Ask`) waits until a slot of the bank is free (`slots.Slots`: the slot whose conversation
shares the longest prefix with the prompt), then reads the part of its prompt the slot does not hold, a
chunk of `chunk` tokens per step (the prompt's ubatch, as `generate.prefill` reads it: the chunks, and so
the prompt's bits, never depend on what else is served), so a long prompt stalls the others' streams for
one chunk at a time. Once read, it samples from its logits at every step and its next token joins the step: the model
runs the step's tokens together (`DecoderBase.step`: each matrix read once for all of them, each expert
once for the tokens routed to it), and each token's logits are those it gets alone, bit for bit, so a
sequence's text does not depend on what else is served. Models without a batched step (a split model,
a first start's exact path) decode the step's tokens one after another.

Everything here runs on the thread that calls `step`; `submit` and `Stream.cancel` may come from others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ..events import BatchStatus, DoneEvent, Event, SamplingParams, TokenEvent, tokens_per_second
from ..generate import UBATCH, ContextFull, Model, decode_one, one_torch_thread, prefill
from ..kernels import threads
from ..kernels.layer_halves import FEW_ROWS
from ..nn.layers import KVCache
from ..sampling import sample
from ..text.tokenizer import StreamDecoder, Tokenizer
from .slots import Slots

logger = logging.getLogger(__name__)

CHUNK = UBATCH  # prompt tokens read per step while others decode


@runtime_checkable
class Stepper(Protocol):
    """A model that runs one token of each of several sequences in one step (`DecoderBase.step`)."""

    def step(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor: ...


@dataclass(frozen=True)
class Ask:
    """What a request asks: a prompt (token ids), how to sample and how many tokens at most."""

    prompt: Sequence[int]
    params: SamplingParams
    max_tokens: int
    ignore_eos: bool = False


@dataclass(eq=False)
class Stream:
    """One request on its way: its slot, what is left of its prompt to read, its sampling state."""

    ask: Ask
    emit: Callable[[Event], None]
    decoder: StreamDecoder  # the reply's text, token by token
    stop: threading.Event = field(default_factory=threading.Event)
    slot: int = -1
    cache: KVCache | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to read
    held: int = 0  # prompt tokens the slot held already
    logits: torch.Tensor | None = None  # what the next token is sampled from
    history: list[int] = field(default_factory=list)
    replied: list[int] = field(default_factory=list)
    gen: torch.Generator | None = None
    t0: float = 0.0
    t1: float = 0.0
    first: float = 0.0
    last: float = 0.0
    done: bool = False

    def cancel(self) -> None:
        """Stop between two steps (a client that went away); the stream ends as "stopped"."""
        self.stop.set()

    def tps(self, now: float) -> float:
        return tokens_per_second(len(self.replied), now - self.first) if self.replied else 0.0


class Batcher:
    def __init__(self, model: Model, tokenizer: Tokenizer, slots: Slots, *, chunk: int = CHUNK) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.slots = slots
        self.chunk = chunk
        self._queue: deque[Stream] = deque()
        self._lock = threading.Lock()
        self._active: list[Stream] = []  # on a slot, in the order they came
        self.steps = 0
        self.last_batch = 0

    def submit(self, ask: Ask, emit: Callable[[Event], None]) -> Stream:
        """Queue a request; its TokenEvents and one DoneEvent go to `emit` from the stepping thread."""
        ask.params.validate()
        if not ask.prompt:
            raise ValueError("empty prompt")
        if len(ask.prompt) >= self.slots.n_ctx:
            raise ContextFull(f"the prompt needs {len(ask.prompt)} positions; the context holds {self.slots.n_ctx}")
        stream = Stream(ask, emit, self.tokenizer.stream_decoder())
        with self._lock:
            self._queue.append(stream)
        return stream

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._queue or self._active)

    def status(self) -> BatchStatus:
        now = time.perf_counter()
        with self._lock:
            active, queued = list(self._active), len(self._queue)
        tps = [0.0] * self.slots.n
        for s in active:
            tps[s.slot] = s.tps(now)
        return BatchStatus(self.slots.n, len(active), queued, self.last_batch, self.steps, tuple(tps))

    def set_model(self, model: Model) -> None:
        """Another model takes over (a first start's fast model): between requests only, and what the slots hold
        was computed by the other one, so they start empty."""
        if self.busy:
            raise RuntimeError("the model changes only while nothing is served")
        self.model = model
        self.slots.clear()

    # -- one step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Admit waiting requests to free slots, read the next chunk of the waiting prompts (as many as fit in one
        chunk's tokens, at least one), then sample every reading-done stream's next token and run them all as one
        decode step."""
        self._admit()
        self._end_stopped()
        budget = self.chunk  # prompt tokens read this step: the next chunk of each waiting prompt while they fit
        for s in [s for s in self._active if s.pending]:
            n = min(len(s.pending), self.chunk)
            if n > budget and budget < self.chunk:
                break
            self._read(s)
            budget -= n
        ready = [s for s in self._active if not s.pending and s.logits is not None and not s.done]
        going = [s for s in ready if self._sample(s)]
        for i in range(0, len(going), FEW_ROWS):
            self._decode(going[i : i + FEW_ROWS])
        self.last_batch = len(going)
        self.steps += 1 if going else 0
        self._retire()
        self._admit()  # a slot freed now serves the next request from the next step on

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                stream = self._queue[0]
                if stream.stop.is_set():
                    self._queue.popleft()
                    stream.done = True
                    stream.emit(DoneEvent(0, 0, 0.0, 0.0, "stopped"))
                    continue
                slot = self.slots.take(stream.ask.prompt)
                if slot is None:
                    return
                self._queue.popleft()
                self._active.append(stream)
            self._start(stream, slot)

    def _start(self, s: Stream, slot: int) -> None:
        prompt = list(s.ask.prompt)
        s.slot, s.t0 = slot, time.perf_counter()
        s.cache, s.held, kept = self.slots.resume(slot, prompt)
        s.pending = prompt[s.held :]
        s.logits = kept
        s.history = list(prompt)
        seed = s.ask.params.seed if s.ask.params.seed is not None else int(time.time_ns() % 2**63)
        s.gen = torch.Generator("cpu").manual_seed(seed)
        if kept is not None:
            s.t1 = s.last = time.perf_counter()

    def _read(self, s: Stream) -> None:
        """A chunk of the stream's prompt; the last one leaves the logits its reply starts from."""
        assert s.cache is not None  # (a stream on a slot)
        part, s.pending = s.pending[: self.chunk], s.pending[self.chunk :]
        logits = prefill(self.model, part, s.cache, ubatch=self.chunk)
        if not s.pending:
            s.logits = logits
            s.t1 = s.last = time.perf_counter()
            self.slots.read(s.slot, s.ask.prompt, logits)

    def _sample(self, s: Stream) -> bool:
        """The stream's next token from its logits, told; whether it goes on into this step."""
        assert s.logits is not None and s.gen is not None and s.cache is not None
        n, ask = len(s.replied), s.ask
        if s.stop.is_set():
            return self._finish(s, "stopped")
        if n >= ask.max_tokens:
            return self._finish(s, "length")
        tok = sample(s.logits, ask.params, s.history, s.gen)
        if self.tokenizer.is_eog(tok) and not ask.ignore_eos:
            return self._finish(s, "eos")
        s.history.append(tok)
        s.replied.append(tok)
        now = time.perf_counter()
        if n == 0:
            s.first = now
        s.emit(TokenEvent(tok, s.decoder.push(tok), n, now - s.last))
        s.last = now
        if n + 1 >= ask.max_tokens:
            return self._finish(s, "length")
        if s.cache.pos >= s.cache.n_ctx:
            return self._finish(s, "context")
        return True

    def _decode(self, group: list[Stream]) -> None:
        caches = [s.cache for s in group if s.cache is not None]
        tokens = [s.replied[-1] for s in group]
        with one_torch_thread(True):
            if len(group) > 1 and isinstance(self.model, Stepper):
                threads.pace()  # as decode_one: the default thread count gives way to other processes' work
                logits = self.model.step(tokens, caches)
                for s, row in zip(group, logits, strict=True):
                    s.logits = row
                return
        for s, tok, cache in zip(group, tokens, caches, strict=True):
            s.logits = decode_one(self.model, tok, cache)

    def _finish(self, s: Stream, reason: str) -> bool:
        tail = s.decoder.flush()
        n = len(s.replied)
        if tail:
            s.emit(TokenEvent(-1, tail, n))
        now = time.perf_counter()
        s.emit(DoneEvent(len(s.ask.prompt) - s.held, n, s.t1 - s.t0, now - s.first if n else 0.0, reason, s.held))
        s.done = True
        return False

    def _end_stopped(self) -> None:
        """A stream cancelled while it reads its prompt ends now (a decoding one at its next token)."""
        for s in self._active:
            if s.pending and s.stop.is_set() and not s.done:
                s.pending = []
                s.emit(DoneEvent(0, 0, time.perf_counter() - s.t0, 0.0, "stopped", s.held))
                s.done = True

    def _retire(self) -> None:
        """Streams that ended give their slot back, keeping what it read for the next request with that prefix."""
        with self._lock:
            ended = [s for s in self._active if s.done]
            self._active = [s for s in self._active if not s.done]
        for s in ended:
            self.slots.give_back(s.slot, [*s.ask.prompt, *s.replied])

    def fail_all(self) -> None:
        """After a step raised: every stream ends (its caller says why); the slots start empty."""
        with self._lock:
            streams = [*self._active, *self._queue]
            self._active, self._queue = [], deque()
        for s in streams:
            s.done = True
        self.slots.clear()
