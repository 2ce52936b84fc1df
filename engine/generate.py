"""Prefill, decode and sampling as free functions; `generate` yields events for every consumer.

The CLI prints the events, the UI renders them, the tuner records them: one stream for all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Protocol

import torch

from .events import GREEDY, DoneEvent, Event, SamplingParams, TokenEvent
from .kernels import threads
from .nn.layers import KVCache
from .sampling import sample
from .text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

UBATCH = 512


class Stopped(Exception):
    """A stop request arrived while the prompt was being read."""


class ContextFull(ValueError):
    """The prompt does not fit in the context."""


class Model(Protocol):
    """What generation needs of a model: logits for tokens at a position."""

    def __call__(self, tokens: torch.Tensor, pos0: int, cache: KVCache, last_only: bool = False) -> torch.Tensor: ...


@contextlib.contextmanager
def ctrl_c_as_itself() -> Iterator[None]:
    """Ctrl-C during a compiled kernel as the KeyboardInterrupt it is.

    A compiled kernel calls back into Python now and then (numba unpickles a constant on a first
    call): a signal handled there surfaces when the kernel returns as "SystemError: ... returned a
    result with an exception set", with the KeyboardInterrupt down its chain of causes. The callers'
    interrupt handling (exit 130, the text kept) would take it for a crash."""
    try:
        yield
    except SystemError as e:
        cause: BaseException | None = e
        while cause is not None:
            if isinstance(cause, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            cause = cause.__cause__
        raise


@torch.inference_mode()
def prefill(
    model: Model, tokens: Sequence[int], cache: KVCache, ubatch: int = UBATCH, stop: threading.Event | None = None
) -> torch.Tensor:
    """Run the prompt through the model in ubatches; returns the last position's logits [V].

    With `stop` set it raises Stopped between ubatches; the KV cache then holds the ubatches that ran.
    """
    if cache.pos + len(tokens) > cache.n_ctx:
        raise ContextFull(f"the prompt needs {cache.pos + len(tokens)} positions; the context holds {cache.n_ctx}")
    ids = torch.tensor(list(tokens), dtype=torch.long)
    logits = None
    for start in range(0, len(tokens), ubatch):
        if stop is not None and stop.is_set():
            raise Stopped(f"stopped after {start} of {len(tokens)} prompt tokens")
        threads.pace()
        # Only the prompt's last position is sampled from: the vocabulary projection of the
        # others (262k x 640 per token on Gemma) would be most of a small model's prefill.
        with ctrl_c_as_itself():
            logits = model(ids[start : start + ubatch], cache.pos, cache, last_only=True)
    if logits is None:
        raise ValueError("empty prompt")
    return logits[-1]


@torch.inference_mode()
def decode_one(model: Model, token: int, cache: KVCache) -> torch.Tensor:
    threads.pace()  # the default thread count gives way to other processes' work
    with one_torch_thread(cache.device.type == "cpu"), ctrl_c_as_itself():
        return model(torch.tensor([token]), cache.pos, cache)[-1]


@contextlib.contextmanager
def one_torch_thread(when: bool) -> Iterator[None]:
    """torch's own ops on one thread (the calling thread's setting), for a CPU decode step.

    At one token torch's ops are tiny (norms, rotary, attention over the cache): a team of
    threads costs more than it saves, and its threads spin on the cores the kernels need.
    """
    n = torch.get_num_threads()
    if not when or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: Sequence[int],
    cache: KVCache,
    *,
    max_tokens: int,
    params: SamplingParams = GREEDY,
    ignore_eos: bool = False,
    stop: threading.Event | None = None,
    before: Sequence[int] = (),
    logits: torch.Tensor | None = None,
    on_prompt: Callable[[torch.Tensor], None] | None = None,
) -> Generator[Event, None, None]:
    """Prefill `prompt` after what `cache` holds, then decode; yields TokenEvents and one DoneEvent.

    `before`: the tokens the cache holds ahead of `prompt` (a resumed prompt): the repeat penalty
    looks back over them as over the prompt. `logits`: the cache holds the whole prompt (`prompt` is
    empty) and these are the logits after it, kept from when it was read. `on_prompt` hears the logits
    after the prompt, before the first token is sampled from them."""
    params.validate()
    seed = params.seed if params.seed is not None else int(time.time_ns() % 2**63)
    t0 = time.perf_counter()
    if logits is None:
        try:
            logits = prefill(model, prompt, cache, stop=stop)
        except Stopped:  # while reading the prompt
            yield DoneEvent(len(prompt), 0, time.perf_counter() - t0, 0.0, "stopped", len(before))
            return
    if on_prompt is not None:
        on_prompt(logits)
    t1 = time.perf_counter()
    gen = torch.Generator(logits.device).manual_seed(seed)  # sampling stays on the model's device
    history = [*before, *prompt]
    decoder = tokenizer.stream_decoder()
    reason, n = "length", 0
    last = first = t1
    while n < max_tokens:
        if stop is not None and stop.is_set():
            reason = "stopped"
            break
        tok = sample(logits, params, history, gen)
        if tokenizer.is_eog(tok) and not ignore_eos:
            reason = "eos"
            break
        history.append(tok)
        now = time.perf_counter()
        if n == 0:
            first = now
        yield TokenEvent(tok, decoder.push(tok), n, now - last)
        last = now
        n += 1
        if n >= max_tokens:
            break
        if cache.pos >= cache.n_ctx:
            reason = "context"
            break
        logits = decode_one(model, tok, cache)
    tail = decoder.flush()
    if tail:
        yield TokenEvent(-1, tail, n)
    yield DoneEvent(len(prompt), n, t1 - t0, time.perf_counter() - first if n else 0.0, reason, len(before))
