"""The engine in-process: a loaded model behind `ChatEngine` (line mode, and the engine process's side).

Loads torch and the kernels: the chat app's UI process never imports this module.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from moechat.app.engine_api import PLAIN_STOPS, Message, ModelInfo
from moechat.app.paths import app_paths
from moechat.app.settings import Settings
from moechat.app.stop_strings import StopStrings
from moechat.app.tuned import file_identity
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.cache.stats import StatsSnapshot
from moechat.engine.events import BatchStatus, Event, SamplingParams, TokenEvent
from moechat.engine.generate import Model, generate
from moechat.engine.loader import ContextTooLarge, LoadedModel, load_model, set_threads
from moechat.engine.nn.layers import KVBank
from moechat.engine.prompt_cache import PromptCache
from moechat.engine.serving.batcher import Ask, Batcher, Stream
from moechat.engine.serving.slots import Slots
from moechat.engine.text.chat_template import ChatTemplateError, plain_template
from moechat.tuner.baselines import MinBound, cache_bound
from moechat.tuner.confirm import confirm
from moechat.tuner.events import SWEEP_MAX_CTX, SWEEP_TOKENS, ConfirmEvent, SweepDone, SweepEvent
from moechat.tuner.recommend import TuneReport, recommend
from moechat.tuner.sweep import SweepSettings, calibrate, forget_runs

if TYPE_CHECKING:
    from moechat.engine.distributed.pipeline import PipelineModel

logger = logging.getLogger(__name__)


def load_for(
    path: Path, settings: Settings, cache: CacheSettings, progress: Callable[[str], None] | None = None,
    first_start: bool = False,
) -> LoadedModel:  # fmt: skip
    """The model as `settings` say (threads, context, template, CPU kernels), with `cache`; `progress`
    hears each kernel a first start compiles. `first_start`: a first start answers from the exact path
    while the kernels compile (engine.models.first_start).

    A context that cannot fit names where its size was set."""
    set_threads(settings.threads)
    try:
        return load_model(path, n_ctx=settings.ctx_size, chat_template=settings.chat_template or None, cache=cache,
                          cpu_dequant_mib=settings.cpu_dequant_mib, cpu_kernels=settings.cpu_kernels,
                          progress=progress, ram_cache_mib=float(settings.ram_cache_mib),
                          emulate_host_mib=settings.emulate_host_mib, first_start=first_start)  # fmt: skip
    except ContextTooLarge as e:
        raise ValueError(f"ctx_size from {settings.source('ctx_size')}: {e}") from None


class RealEngine:
    def __init__(self, lm: LoadedModel, base: CacheSettings, identity: str | None = None,
                 split: PipelineModel | None = None) -> None:  # fmt: skip
        """`identity`: the file's `file_identity` when the caller has it already (it reads 16 MiB).
        `split`: on rank 0 of a model split over hosts (engine/distributed), the whole model, `lm` being
        rank 0's own stage; replies, the cache's counters and its settings then reach every stage."""
        self.lm = lm
        self.split = split
        self.model: Model = split if split is not None else lm.runner
        self.base = base  # device, link, load mode: what a cache change keeps
        cfg = lm.config
        dev = base.device
        hw = torch.cuda.get_device_name() if dev == "cuda" else (platform.processor() or platform.machine())
        self.info = ModelInfo(
            name=lm.gguf.path.name, path=str(lm.gguf.path), sha256_head=identity or file_identity(lm.gguf.path),
            arch=cfg.arch,
            n_layers=cfg.n_layers, n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used, n_ctx=lm.n_ctx,
            device=dev, hardware=f"{hw}, {torch.get_num_threads()} threads", template=lm.template.origin,
            template_note=lm.template.fallback_reason, cache_note=auto_words(lm),
        )  # fmt: skip
        self.plain = lm.template.origin == "plain fallback"
        # The conversation's KV cache, kept from one reply to the next.
        self.recurrent = any(lm.config.is_recurrent(i) for i in range(lm.config.n_layers))
        self.prompts = PromptCache(lm.new_cache, can_roll_back=not self.recurrent)
        self.asked: CacheSettings | None = None  # a cache set during a first start's exact path, for the fast model
        self._batcher: Batcher | None = None  # serving many requests at once (`batcher`)
        if lm.first_start is not None:
            lm.first_start.begin_upgrade()

    def _upgrade(self, wait: bool = False) -> None:
        """A first start's fast model in place of the exact path, once its kernels are loaded (`wait`: until
        then), between replies: the conversation's prefix is read again by the fast model."""
        fs = self.lm.first_start
        fast = fs.take(wait) if fs is not None else None
        if fast is None:
            return
        old, self.lm, self.model = self.lm, fast, fast.runner
        self.prompts = PromptCache(fast.new_cache, can_roll_back=not self.recurrent)
        if self.asked is not None:
            fast.set_cache(self.asked)
        self.info = replace(self.info, cache_note=auto_words(fast))
        old.close()

    def fit_messages(self, messages: Sequence[Message]) -> tuple[list[int], int, str]:
        msgs = list(messages)
        dropped = 0
        note = ""
        while True:
            try:
                text = self.lm.template.render(msgs, add_generation_prompt=True)
            except ChatTemplateError as e:
                # Untrusted template code failed on this conversation: plain format from now on.
                note = f"{e}; using the plain User:/Assistant: format from now on"
                logger.warning("%s", note)
                self.lm.template = plain_template(self.lm.template.bos_token, self.lm.template.eos_token, str(e))
                self.plain = True
                continue
            tokens = self.lm.tokenizer.encode(text, parse_special=True)
            # Leave room to answer: a quarter of the context, at most 256 tokens.
            if len(tokens) + min(256, self.lm.n_ctx // 4) <= self.lm.n_ctx:
                return tokens, dropped, note
            first = 1 if msgs and msgs[0]["role"] == "system" else 0
            if len(msgs) - first <= 1:
                return tokens[-(self.lm.n_ctx * 3 // 4) :], dropped, note  # one huge message: keep its end
            del msgs[first]
            dropped += 1

    def chat_tokens(self, messages: Sequence[Message]) -> list[int]:
        try:
            return self.lm.chat_tokens(list(messages))
        except ChatTemplateError as e:
            raise ValueError(f"the model's chat template failed on these messages: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self.lm.tokenizer.encode(text)

    def reply(
        self, prompt: list[int], params: SamplingParams, max_tokens: int, stop: threading.Event,
        stops: Sequence[str] = (),
    ) -> Iterator[Event]:  # fmt: skip
        """The reply to `prompt`, read after the part of it the conversation's cache already holds: the
        DoneEvent's `n_prompt` counts the tokens read now. The text ends at the first of `stops` (and of the
        plain format's own), cut here and nowhere else; a reply that met one ends as "eos"."""
        self._upgrade()
        cutter = self._stop_strings(stops)
        max_tokens = max(1, min(max_tokens, self.lm.n_ctx - len(prompt)))
        kv, held, kept = self.prompts.resume(prompt)
        replied: list[int] = []
        after: list[tuple[int, torch.Tensor]] = []  # the logits after the prompt, kept for the same prompt again
        try:
            for ev in generate(self.model, self.lm.tokenizer, prompt[held:], kv, max_tokens=max_tokens,
                               params=params, stop=stop, before=prompt[:held], logits=kept,
                               on_prompt=lambda logits: after.append((len(prompt), logits))):  # fmt: skip
                if isinstance(ev, TokenEvent) and ev.token >= 0:
                    replied.append(ev.token)
                yield from _cut(cutter, ev, stop.set)
        finally:
            self.prompts.record([*prompt, *replied], after[0] if after else None)

    # -- many requests at once (`moechat serve --parallel N`) ----------------------------------------

    def batcher(self, n_slots: int) -> Batcher:
        """The batcher that serves requests on `n_slots` KV slots of this model, made at the first call."""
        if self._batcher is None:
            bank = KVBank(self.lm.config, self.lm.n_ctx, n_slots, device=self.lm.model.device)
            self._batcher = Batcher(self.model, self.lm.tokenizer, Slots(bank, can_roll_back=not self.recurrent))
        return self._batcher

    def submit(self, prompt: list[int], params: SamplingParams, max_tokens: int, stops: Sequence[str],
               emit: Callable[[Event], None]) -> Stream:  # fmt: skip
        """`reply` on the batcher: the request's events go to `emit` from the stepping thread, its text cut at
        the first of `stops` as `reply` cuts it."""
        if self._batcher is None:
            raise RuntimeError("no batcher: call batcher() first")
        cutter = self._stop_strings(stops)
        max_tokens = max(1, min(max_tokens, self.lm.n_ctx - len(prompt)))
        stream: list[Stream] = []

        def cut(ev: Event) -> None:
            for out in _cut(cutter, ev, stream[0].cancel):
                emit(out)

        stream.append(self._batcher.submit(Ask(prompt, params, max_tokens), cut))
        return stream[0]

    def _stop_strings(self, stops: Sequence[str]) -> StopStrings:
        """A reply's stop strings: the request's, and the plain format's own where it is in use."""
        return StopStrings((*PLAIN_STOPS, *stops) if self.plain else tuple(stops))

    def between_requests(self) -> None:
        """Nothing is served: a first start's fast model takes over here (the slots start empty)."""
        before = self.model
        self._upgrade()
        if self._batcher is not None and self.model is not before:
            self._batcher.set_model(self.model)

    def batch_status(self) -> BatchStatus | None:
        return self._batcher.status() if self._batcher is not None else None

    def snapshot(self) -> StatsSnapshot | None:
        if self.split is not None:
            return self.split.snapshot()
        snap = self.lm.cache.snapshot() if self.lm.cache is not None else None
        tier = self.lm.ram_tier
        if tier is None:
            return snap
        if snap is None:  # the tier alone: a snapshot without slot groups, which carries it
            return StatsSnapshot(time.time(), tier.tokens, (), (), 0.0, ram=tier.snapshot())
        return replace(snap, ram=tier.snapshot())

    def cache(self) -> tuple[float, float]:
        if self.asked is not None and self.lm.first_start is not None:
            return self.asked.mib, self.asked.cpu_share
        c = self.lm.cache
        return (c.settings.mib, c.settings.cpu_share) if c is not None else (0.0, 0.0)

    def min_bound(self) -> MinBound | None:
        c = self.lm.cache
        if c is None or self.split is not None:  # (a split: rank 0's log holds its own layers only)
            return None
        return cache_bound(c)

    def set_cache(self, mib: float, share: float) -> None:
        settings = replace(self.base, mib=mib, cpu_share=share, trace=None)
        settings.validate()
        if self.split is not None:
            self.split.set_cache(settings)  # every stage: the size is each host's
        elif self.lm.first_start is not None:  # the exact path has no cache: the fast model takes this one
            self.asked = settings
        else:
            self.lm.set_cache(settings)

    def _one_process(self) -> None:
        if self.split is not None:
            raise ValueError("the tuning wizard measures a model in one process, not one split over hosts: "
                             "record the routing (--moe-cache-trace) and replay it with `moechat sim`")  # fmt: skip
        self._upgrade(wait=True)  # the wizard measures the fast kernels, once a first start has them

    def _sweep_settings(self, max_mib: float | None = None, tokens: int = SWEEP_TOKENS) -> SweepSettings:
        return SweepSettings(
            model=Path(self.info.path), device=self.base.device, n_ctx=min(self.lm.n_ctx, SWEEP_MAX_CTX),
            emulate_link_gbps=self.base.emulate_link_gbps, load_mode=self.base.load_mode,
            cpu_dequant_mib=self.lm.cpu_dequant_mib, cpu_kernels=self.lm.cpu_kernels, max_mib=max_mib,
            tokens=tokens, warmup=min(32, tokens // 4),
        )  # fmt: skip

    def sweep(self, stop: threading.Event, max_mib: float | None, tokens: int, fresh: bool = False,
              check: bool = False) -> Iterator[SweepEvent]:  # fmt: skip
        self._one_process()
        mib, share = self.cache()
        settings = self._sweep_settings(max_mib, tokens)
        if fresh:
            forget_runs(settings, app_paths().cache)
        try:
            yield from calibrate(settings, cache_dir=app_paths().cache, stop=stop, loaded=self.lm, check_noise=check)
        finally:
            self.set_cache(mib, share)  # the session's own cache again, whatever happened

    def recommend(self, done: SweepDone) -> TuneReport:
        return recommend(done, self.info.name, workers=1)

    def confirm(self, stop: threading.Event, current: tuple[float, float],
                recommended: tuple[float, float]) -> Iterator[ConfirmEvent]:  # fmt: skip
        self._one_process()
        mib, share = self.cache()
        try:
            yield from confirm(self.lm, self._sweep_settings(), current, recommended, stop=stop)
        finally:
            self.set_cache(mib, share)  # the session's own cache again, whatever happened

    def close(self) -> None:
        if self.split is None:  # a split's stage is closed where it was loaded (run_split), after the join
            self.lm.close()


def _cut(cutter: StopStrings, ev: Event, stop: Callable[[], None]) -> list[Event]:
    """A reply's event with its text cut at the first stop string, cut here and nowhere else: a token's text that
    is safe to show (once one is found, `stop` ends the reply), the end after the text held back, as "eos" where a
    stop string ended the reply (one in the last token allowed too)."""
    if isinstance(ev, TokenEvent):
        text = cutter.push(ev.text)
        if cutter.hit:
            stop()
        return [replace(ev, text=text)]
    tail = cutter.flush()
    done = replace(ev, stop_reason="eos") if cutter.hit else ev
    return [TokenEvent(-1, tail, ev.n_generated), done] if tail else [done]


def auto_words(lm: LoadedModel) -> str:
    """What --moe-cache-mib auto made of the cache, for the chat's info line and the dashboard ("": no auto)."""
    f = lm.fit
    if lm.first_start is not None:
        return "off for now: this first start answers from the exact path while the kernels compile (a minute or two)"
    if lm.ram_tier is not None and lm.ram_fit is not None:  # the experts in a RAM tier: no device cache over it yet
        r = lm.ram_fit
        return f"off: the experts run from a RAM tier of {r.tier / 2**20:,.0f} MiB ({100 * r.fraction:.0f}% of them)"
    if f is None:
        return ""
    if f.cache <= 0:
        return f"auto: off ({f.note})"
    return f"auto: {f.cache:,.0f} MiB of {f.experts:,.0f} MiB of experts ({f.note})"
