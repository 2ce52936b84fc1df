"""A scripted engine for UI tests: the same events and snapshots as the real one, no model.

Only the UI tests use it; everything below the UI is tested on real models.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from moechat.app.engine_api import Message, ModelInfo
from moechat.engine.cache.stats import CountersSnapshot, GroupInfo, LayerSnapshot, StatsSnapshot, TierSnapshot
from moechat.engine.events import DoneEvent, Event, SamplingParams, TokenEvent
from moechat.tuner.baselines import MinBound
from moechat.tuner.events import (
    N_ARMS,
    Arm,
    ArmDone,
    ArmProgress,
    ArmStarted,
    Cancelled,
    ConfirmDone,
    ConfirmEvent,
    NoiseCheck,
    SweepDone,
    SweepEvent,
)
from moechat.tuner.recommend import Recommendation, Row, TuneReport
from moechat.tuner.time_model import TimeModel

N_LAYERS, N_EXPERT, K = 4, 8, 2


class FakeEngine:
    def __init__(self, words: Sequence[str] = ("Hello", " there", ",", " friend", "."), *, delay: float = 0.0,
                 fail_after: int | None = None, sweep_delay: float = 0.0, n_ctx: int = 256,
                 n_layers: int = N_LAYERS, n_expert: int = N_EXPERT, cache_note: str = "",
                 ram_tier: bool = False) -> None:  # fmt: skip
        self.words = list(words)
        self.n_layers, self.n_expert = n_layers, n_expert
        self.delay, self.fail_after, self.sweep_delay = delay, fail_after, sweep_delay
        self.sweeps: list[bool] = []  # each sweep asked for: whether fresh
        self.checks: list[bool] = []  # ... and whether it checked for noise first
        self.noise: list[tuple[float, ...]] = []  # scripted: each noise check's parts (t/s); steady when empty
        self.window_after = 4096  # tokens after which the MIN bound covers a window of recent ones
        self.info = ModelInfo("fake.gguf", "/nonexistent/fake.gguf", "0" * 64, "fakemoe", n_layers, n_expert, K,
                              n_ctx, "cpu", "test machine", "gguf", cache_note=cache_note)  # fmt: skip
        # "auto: off (...)": the engine runs without a cache (no snapshots), as auto leaves it on the CPU device.
        self.mib, self.share = (0.0 if cache_note.startswith("auto: off") else 1.0), 0.0
        self.ram_tier = ram_tier  # the experts in a RAM tier and no device cache: snapshots carry the tier alone
        self.tokens = 0
        self.set_cache_calls: list[tuple[float, float]] = []
        self.replies = 0
        self.params: list[SamplingParams] = []  # what each reply was asked with
        self.min_calls = 0
        self.confirms: list[tuple[tuple[float, float], tuple[float, float]]] = []
        self.confirm_tps: tuple[tuple[float, ...], tuple[float, ...]] = ((70.0, 71.0), (84.0, 85.5))  # a clear win
        self.closed = False
        self.pause = False  # a test holds a reply mid-stream by setting this, and lets it go by clearing it
        self.off_ms = 50.0  # the sweep's run without a cache: ms per token (slower than every cache's, scripted)

    def fit_messages(self, messages: Sequence[Message]) -> tuple[list[int], int, str]:
        n = sum(len(m["content"].split()) + 4 for m in messages)
        return list(range(n)), 0, ""

    def chat_tokens(self, messages: Sequence[Message]) -> list[int]:
        return self.fit_messages(messages)[0]

    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))

    def reply(
        self, prompt: list[int], params: SamplingParams, max_tokens: int, stop: threading.Event,
        stops: Sequence[str] = (),
    ) -> Iterator[Event]:  # fmt: skip
        self.replies += 1
        self.params.append(params)
        t0 = time.perf_counter()
        n = 0
        reason = "eos"
        for i, w in enumerate(self.words[:max_tokens]):
            if stop.is_set():
                reason = "stopped"
                break
            if self.fail_after is not None and i == self.fail_after:
                raise RuntimeError("injected engine failure")
            if self.delay:
                time.sleep(self.delay)
            while self.pause and not stop.is_set():
                time.sleep(0.01)
            self.tokens += 1
            n += 1
            yield TokenEvent(i, w, i, self.delay)
        yield DoneEvent(len(prompt), n, 0.01, time.perf_counter() - t0, reason)

    def snapshot(self) -> StatsSnapshot | None:
        if self.ram_tier:
            t = self.tokens
            lookups = t * K * self.n_layers
            ram = TierSnapshot(12, self.n_layers * self.n_expert, 12000, lookups, lookups - t, t, t, t // 2, t * K,
                               t * K - t // 3, t * K, 1000 * 2 * t, 0.01 * t)  # fmt: skip
            return StatsSnapshot(time.time(), t, (), (), 0.0, ram=ram)
        if not self.mib:
            return None
        t = self.tokens
        layers = []
        for layer in range(self.n_layers):
            hits = t * K * 3 // 4
            miss = t * K - hits
            c = CountersSnapshot(lookups=t * K, hits=hits, misses=miss, cpu=miss // 2, uploads=miss - miss // 2,
                                 uploaded_bytes=1000 * t, calls=t, tokens=t)  # fmt: skip
            use = tuple((t * (e + 1)) // self.n_expert for e in range(self.n_expert))
            layers.append(LayerSnapshot(layer, 0, c, CountersSnapshot(), 3, (0, 1, 2), use))
        group = GroupInfo(0, tuple(range(self.n_layers)), self.n_expert, 1000, 12, 12000)
        return StatsSnapshot(time.time(), t, (group,), tuple(layers), self.share)

    def cache(self) -> tuple[float, float]:
        return self.mib, self.share

    def min_bound(self) -> MinBound | None:
        self.min_calls += 1
        # scripted: above the 75% the snapshots give; a window once the chat is long
        return MinBound(0.9, 0.75, self.tokens, self.tokens < self.window_after) if self.tokens else None

    def set_cache(self, mib: float, share: float) -> None:
        self.set_cache_calls.append((mib, share))
        self.mib, self.share = mib, share

    def sweep(self, stop: threading.Event, max_mib: float | None, tokens: int, fresh: bool = False,
              check: bool = False) -> Iterator[SweepEvent]:  # fmt: skip
        self.sweeps.append(fresh)
        self.checks.append(check)
        if check:
            noise = NoiseCheck(self.noise.pop(0) if self.noise else (50.0, 51.0, 50.5), 0.25)
            yield noise
            if not noise.steady:
                return
        arms = []
        plan = [(0.5, 0.0), (0.5, 0.5), (0.5, 0.95), (1.5, 0.0), (1.5, 0.5), (1.5, 0.95), (0.0, 0.0)]  # last: off
        for i, (mib, share) in enumerate(plan):
            yield ArmStarted(i, N_ARMS, mib, share)
            for k in range(0, tokens + 1, max(1, tokens // 4)):
                if stop.is_set():
                    raise Cancelled(f"arm {i + 1} stopped")
                if self.sweep_delay:
                    time.sleep(self.sweep_delay)
                yield ArmProgress(i, N_ARMS, k, tokens)
            hit_rate = 0.5 + 0.05 * i if mib else 0.0
            arm = Arm(mib, share, tokens, self.off_ms if not mib else 10.0 + i, hit_rate, 0.001, 0.001 * share,
                      100.0, 100.0, 1, f"{i}.trace" if mib else "")  # fmt: skip
            arms.append(arm)
            yield ArmDone(i, N_ARMS, arm, cached=False)
        yield SweepDone(Path("/nonexistent"), tuple(arms[:-1]), 2.0, 8.0, "cpu", off=arms[-1])

    def recommend(self, done: SweepDone) -> TuneReport:
        shares = (0.0, 0.5, 0.8, 0.9, 0.95, 0.98)
        rows = (Row(0.5, (50.0, 60.0, 61.0, 62.0, 62.5, 62.0), (0.5,) * 6, 3),
                Row(1.5, (70.0, 80.0, 84.0, 85.0, 85.5, 85.0), (0.8,) * 6, 3))  # fmt: skip
        model = TimeModel(5.0, 300.0, 200.0, 0.5, -10.0, True, (0.01,) * 6)
        rec = Recommendation(1.5, 0.9, 85.0, 70.0, all_fit=False)
        warnings: tuple[str, ...] = ()
        if done.off is not None and done.off.tps > rec.tps:  # scripted as the real advice goes
            rec = Recommendation(0.0, 0.0, done.off.tps, done.off.tps, all_fit=False, measured=True)
            warnings = ("no cache is fastest here",)
        return TuneReport("fake.gguf", "cpu", 2.0, 8.0, done.arms, model, shares, rows, rec, 0.5, warnings, done.off)

    def confirm(self, stop: threading.Event, current: tuple[float, float],
                recommended: tuple[float, float]) -> Iterator[ConfirmEvent]:  # fmt: skip
        """Scripted: `confirm_tps` gives (current's, recommended's) t/s per repeat."""
        self.confirms.append((current, recommended))
        cur, rec = self.confirm_tps
        for i, (mib, share) in enumerate([current, recommended] * len(cur)):
            yield ArmStarted(i, 2 * len(cur), mib, share)
        yield ConfirmDone(current, recommended, cur, rec)

    def close(self) -> None:
        self.closed = True
