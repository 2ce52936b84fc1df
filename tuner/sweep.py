"""The calibration sweep: a few timed generations at 2 cache sizes x 3 CPU shares, and one without a
cache, in process. The last is the baseline every cache must beat: on the CPU device (and beside a
slow link) no cache can be the fastest setting, and the advice then says so.

The model is loaded once; each arm gets a fresh cache, generates a fixed prompt for a few hundred
tokens ignoring end-of-generation, and records its routing trace. The arm's traffic per token
comes from replaying its own trace at its own settings over the timed window (exactly the engine's
counters there). On the CPU device the arms run together, a token of each in turn, so a shared
machine's ups and downs fall on every arm alike; on a GPU (one bank of slots at a time) they run
one after another, and an arm whose second half is much slower than its first ran on a busy
machine and runs once more, as the seed does.

Finished arms are kept under the cache dir, keyed by the model file's identity and every
argument that changes speed; a second sweep with the same arguments reuses them. An arm is
written only once it has finished, so a cancelled sweep leaves no partial result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from moechat.engine.cache.device_memory import device_free_bytes
from moechat.engine.cache.expert_cache import ExpertCache
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.cache.slot_groups import layer_groups
from moechat.engine.events import DoneEvent, Event, SamplingParams, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import LoadedModel, load_model
from moechat.tuner.events import (
    CALIB_SHARES,
    SWEEP_TOKENS,
    SWEEP_WARMUP,
    Arm,
    ArmDone,
    ArmProgress,
    ArmStarted,
    Cancelled,
    NoiseCheck,
    SweepDone,
    SweepEvent,
    nice_mib,
)
from moechat.tuner.simulator import load_routing, replay

from moechat import __version__

logger = logging.getLogger(__name__)

SMALL_FRACTION, LARGE_FRACTION = 0.10, 0.30
BUSY_RATIO = 1.5  # second half this much slower than the first: the machine was busy
# The noise check: NOISE_PARTS parts of about NOISE_PART_S seconds each, after NOISE_WARMUP tokens.
# On the 2-core test host the demo's parts differed by 6-14% when quiet (59% once, another tenant
# busy), and by 64-161% beside two processes each busy 0.5 s of every 1.2 s.
NOISE_PARTS, NOISE_PART_S, NOISE_WARMUP, NOISE_MIN_PART, NOISE_MAX_PART = 3, 0.4, 4, 4, 64
NOISE_BOUND = 0.25
PROMPT = (
    "The lighthouse stood at the end of a long spit of rock, and every evening the keeper climbed its "
    "stairs to light the lamp. He kept a journal of the ships he saw, the weather, and the birds that "
    "rested on the rail. One autumn night a small boat without lights drifted toward the rocks, and"
)


@dataclass(frozen=True)
class SweepSettings:
    model: Path
    device: str = "cpu"
    n_ctx: int = 2048
    emulate_link_gbps: float = 0.0
    load_mode: str = "mmap"
    cpu_dequant_mib: float = 0.0
    cpu_kernels: str = "fast"
    max_mib: float | None = None
    tokens: int = SWEEP_TOKENS  # generated per arm
    warmup: int = SWEEP_WARMUP  # first tokens of an arm, not timed
    seed: int = 1
    prompt: str = PROMPT

    def key(self) -> str:
        """Identity of the runs: the model file and every argument that changes their speed.

        Not the context size: a run fills a few hundred positions whatever the cache holds, and
        the wizard (the session's context) and `moechat tune` (its own) share their runs.
        """
        st = self.model.stat()
        ident = {
            "model": str(self.model.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "device": self.device, "link": self.emulate_link_gbps, "load_mode": self.load_mode,
            "dequant_mib": self.cpu_dequant_mib, "kernels": self.cpu_kernels, "tokens": self.tokens,
            "warmup": self.warmup, "seed": self.seed, "prompt": self.prompt,
            "threads": torch.get_num_threads(), "version": __version__, "measured": RUNS_MEASURED,
        }  # fmt: skip
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def available_mib(device: str) -> float:
    """Room for a cache on the device, leaving headroom for everything else."""
    free = device_free_bytes(torch.device(device)) / 2**20
    if device == "cuda":
        return max(0.0, free - 512)
    return max(0.0, 0.75 * free - 1024)  # host RAM: the model, the KV cache and everyone else live there too


def min_cached_mib(lm: LoadedModel) -> float:
    """The smallest budget that caches every group (each group's slots hold one token's experts)."""
    host = lm.model.host_experts.layers
    total = sum(lx.bytes_per_expert * lx.gate.raw.shape[0] for lx in host.values())
    need = 0.0
    for layers in layer_groups(lm.model.host_experts):
        lx = host[layers[0]]
        group_bytes = len(layers) * lx.bytes_per_expert * lx.gate.raw.shape[0]
        need = max(need, (lm.config.n_expert_used + 1) * lx.bytes_per_expert * total / group_bytes)
    return need / 2**20


def calibration_sizes(expert_mib: float, min_mib: float, room_mib: float, device: str) -> tuple[float, float]:
    """The two cache sizes the arms run at: about 10% and 30% of the experts where those cache at
    all, else the smallest size that caches (k + 1 experts per layer) and halfway from it to the
    largest (every expert, or the room there is). ValueError, naming the reason, when no two sizes fit."""
    top = min(expert_mib, room_mib)
    small = nice_mib(max(SMALL_FRACTION * expert_mib, min_mib))
    if small < min_mib:  # rounded below what caches: whole MiB up instead
        small = float(math.ceil(min_mib))
    large = nice_mib(min(max(LARGE_FRACTION * expert_mib, (small + top) / 2), top))
    if large <= small:
        if room_mib < expert_mib:
            raise ValueError(
                f"no room for two cache sizes on {device}: the smallest that caches is {min_mib:.1f} MiB "
                f"(k + 1 experts per layer) and {room_mib:.0f} MiB are available; raise --max-mib or free memory"
            )
        raise ValueError(
            f"the model's experts ({expert_mib:.1f} MiB) leave no two cache sizes between the smallest that caches "
            f"({min_mib:.1f} MiB, k + 1 experts per layer) and all of them: there is nothing to tune"
        )
    return small, large


def load_for_sweep(settings: SweepSettings) -> LoadedModel:
    """The model as the arms run it: no cache yet (each arm brings its own), the settings' CPU kernels."""
    on_device = CacheSettings(mib=0, device=settings.device, load_mode=settings.load_mode)
    return load_model(settings.model, n_ctx=settings.n_ctx, cache=on_device, cpu_dequant_mib=settings.cpu_dequant_mib,
                      cpu_kernels=settings.cpu_kernels)  # fmt: skip


def calibrate(
    settings: SweepSettings,
    *,
    cache_dir: Path,
    stop: threading.Event | None = None,
    loaded: LoadedModel | None = None,
    check_noise: bool = False,
) -> Iterator[SweepEvent]:
    """Run (or reuse) the six arms; yields progress and, last, SweepDone.

    `check_noise`: before any arm is measured, a short run timed in parts (`noise_check`); when the
    parts differ beyond NOISE_BOUND the sweep yields that NoiseCheck and ends there, without
    SweepDone, and the caller asks the user to wait or go on."""
    run_dir = runs_dir(settings, cache_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    own = loaded is None
    lm = loaded or load_for_sweep(settings)
    try:
        if not lm.config.is_moe:
            raise ValueError(f"{settings.model.name} is not a MoE model: there is no expert cache to tune")
        host = lm.model.host_experts.layers
        expert_mib = sum(lx.bytes_per_expert * lx.gate.raw.shape[0] for lx in host.values()) / 2**20
        room = available_mib(settings.device)
        if settings.max_mib is not None:
            room = min(room, settings.max_mib)
        small, large = calibration_sizes(expert_mib, min_cached_mib(lm), room, settings.device)
        plan = [(small, s) for s in CALIB_SHARES] + [(large, s) for s in CALIB_SHARES] + [(0.0, 0.0)]  # last: off
        prompt = lm.tokenizer.encode(settings.prompt)
        arms: dict[int, Arm] = {}
        todo: list[tuple[int, float, float]] = []
        for i, (mib, share) in enumerate(plan):
            meta = run_dir / f"{_arm_name(mib, share)}.json"
            if meta.is_file() and (mib <= 0 or (run_dir / f"{_arm_name(mib, share)}.trace").is_file()):
                try:
                    arms[i] = Arm(**json.loads(meta.read_text()))
                    yield ArmDone(i, len(plan), arms[i], cached=True)
                    continue
                except (ValueError, TypeError) as e:
                    logger.warning("ignoring an unreadable cached run %s: %s", meta, e)
            todo.append((i, mib, share))
        if todo and check_noise:
            noise = noise_check(lm, settings, prompt, stop)
            yield noise
            if not noise.steady:
                return
        if settings.device == "cpu" and len(todo) > 1:
            # The CPU device's slots are the host copy: every arm's cache can exist at once, and the
            # arms run token by token in turn, so a shared machine's drift falls on all of them alike.
            measured = yield from run_arms_interleaved(lm, settings, run_dir, todo, len(plan), prompt, stop)
        else:
            measured = {}
            for i, mib, share in todo:
                yield ArmStarted(i, len(plan), mib, share)
                measured[i] = yield from _run_checked(lm, settings, run_dir, mib, share, prompt, i, len(plan), stop)
                yield from _finish(run_dir, i, len(plan), measured[i])
        arms.update(measured)
        yield SweepDone(run_dir, tuple(arms[i] for i in range(len(plan) - 1)), expert_mib, room, settings.device,
                        off=arms[len(plan) - 1],
                        no_link=settings.device == "cpu" and not settings.emulate_link_gbps)  # fmt: skip
    finally:
        lm.set_cache(None)
        if own:
            lm.close()


def noise_check(lm: LoadedModel, settings: SweepSettings, prompt: list[int],
                stop: threading.Event | None) -> NoiseCheck:  # fmt: skip
    """One greedy generation without a cache, its tokens timed in NOISE_PARTS parts of about
    NOISE_PART_S seconds each (the first tokens set the part's length): a few seconds at most."""
    lm.set_cache(None)
    step: list[float] = []
    per_part = 0
    last = time.perf_counter()
    for ev in generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=lm.n_ctx - len(prompt) - 1,
                       ignore_eos=True, stop=stop):  # fmt: skip
        now = time.perf_counter()
        if isinstance(ev, DoneEvent):
            if ev.stop_reason == "stopped":
                raise Cancelled("stopped during the noise check")
            break
        if ev.token < 0:
            continue
        step.append(now - last)
        last = now
        if len(step) == NOISE_WARMUP + 2:  # the pace after the warm-up sets each part's length
            rate = 2 / sum(step[-2:])
            per_part = min(NOISE_MAX_PART, max(NOISE_MIN_PART, math.ceil(NOISE_PART_S * rate)))
        if per_part and len(step) >= NOISE_WARMUP + 2 + NOISE_PARTS * per_part:
            break
    timed = step[NOISE_WARMUP + 2 :]
    if per_part == 0 or len(timed) < NOISE_PARTS * per_part:  # the context ran out first: what there is
        per_part = max(1, len(timed) // NOISE_PARTS)
    parts = [timed[k * per_part : (k + 1) * per_part] for k in range(NOISE_PARTS)]
    return NoiseCheck(tuple(len(p) / sum(p) for p in parts if p and sum(p) > 0), NOISE_BOUND)


def _arm_name(mib: float, share: float) -> str:
    return f"run-{mib:g}-{share:g}"


def _arm_cache(settings: SweepSettings, mib: float, share: float, trace: Path) -> CacheSettings:
    """An arm's expert cache: its size and share, the sweep's device and link, its routing traced."""
    return CacheSettings(mib=mib, cpu_share=share, device=settings.device, emulate_link_gbps=settings.emulate_link_gbps,
                         trace=trace, load_mode=settings.load_mode)  # fmt: skip


def _arm_sampling(settings: SweepSettings, index: int) -> SamplingParams:
    """An arm's sampling: varied text (a chat's routing, not a greedy loop's), seeded per arm."""
    return SamplingParams(temperature=0.8, seed=settings.seed + index)


def _run_checked(lm: LoadedModel, settings: SweepSettings, run_dir: Path, mib: float, share: float,
                 prompt: list[int], i: int, n_arms: int, stop: threading.Event | None,
                 ) -> Generator[SweepEvent, None, Arm]:  # fmt: skip
    """One arm alone; once more if its second half ran much slower than its first (a busy machine)."""
    for attempt in (1, 2):
        arm = yield from run_arm(lm, settings, run_dir, _arm_name(mib, share), mib, share, prompt, i, n_arms, stop,
                                 attempt)  # fmt: skip
        if arm.second_half_tps * BUSY_RATIO >= arm.first_half_tps or attempt == 2:
            break
        logger.info("arm %d: second half %.1f t/s vs %.1f: machine busy? running it again",
                    i + 1, arm.second_half_tps, arm.first_half_tps)  # fmt: skip
    return arm


def _finish(run_dir: Path, i: int, n_arms: int, arm: Arm) -> Iterator[SweepEvent]:
    _atomic_write(run_dir / f"{_arm_name(arm.mib, arm.share)}.json", json.dumps(asdict(arm), indent=1))
    yield ArmDone(i, n_arms, arm, cached=False)


def run_arms_interleaved(
    lm: LoadedModel,
    settings: SweepSettings,
    run_dir: Path,
    todo: list[tuple[int, float, float]],
    n_arms: int,
    prompt: list[int],
    stop: threading.Event | None,
) -> Generator[SweepEvent, None, dict[int, Arm]]:
    """The arms `todo` [(index, MiB, share)] at once, one token of each in turn (CPU device only).

    Each arm has its own cache, KV cache, trace and sampling seed, as if it ran alone; the model's
    experts are switched to an arm's cache for its token. A token's time is the generator's step
    that made it, so an arm's timing holds its own work only."""
    lm.set_cache(None)
    runs: list[tuple[int, float, float, Path, ExpertCache | None, Generator[Event, None, None], list[float]]] = []
    try:
        for i, mib, share in todo:
            partial = run_dir / f"{_arm_name(mib, share)}.trace.part"
            cache = None if mib <= 0 else ExpertCache(
                lm.model.host_experts, lm.config.n_expert_used, _arm_cache(settings, mib, share, partial)
            )  # fmt: skip
            gen = generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=settings.tokens,
                           params=_arm_sampling(settings, i), ignore_eos=True, stop=stop)  # fmt: skip
            runs.append((i, mib, share, partial, cache, gen, []))
            yield ArmStarted(i, n_arms, mib, share)
        last_report = 0.0
        n_done = 0
        while n_done < settings.tokens:
            for i, _, _, _, cache, gen, seconds in runs:
                lm.model.experts = cache if cache is not None else lm.model.host_experts
                while True:  # to this arm's next token (its first step reads the prompt too)
                    t = time.perf_counter()
                    ev = next(gen, None)
                    took = time.perf_counter() - t
                    if isinstance(ev, DoneEvent) and ev.stop_reason == "stopped":
                        raise Cancelled(f"the runs stopped after {n_done} tokens each")
                    if ev is None or isinstance(ev, DoneEvent):
                        raise RuntimeError(f"arm {i + 1} ended after {len(seconds)} tokens")
                    if isinstance(ev, TokenEvent) and ev.token >= 0:
                        seconds.append(took)
                        break
            n_done += 1
            now = time.monotonic()
            if now - last_report >= 0.25 or n_done <= 4 or n_done == settings.tokens:
                last_report = now
                for i, *_ in runs:
                    yield ArmProgress(i, n_arms, n_done, settings.tokens)
        out = {}
        lm.model.experts = lm.model.host_experts
        for i, mib, share, partial, cache, gen, seconds in runs:
            gen.close()
            trace = None
            if cache is not None:
                cache.close()  # closes the trace
                trace = run_dir / f"{_arm_name(mib, share)}.trace"
                os.replace(partial, trace)
            out[i] = _arm_result(settings, trace, mib, share, prompt, seconds, 1)
            yield from _finish(run_dir, i, n_arms, out[i])
        return out
    finally:
        lm.model.experts = lm.model.host_experts
        for _, _, _, partial, cache, gen, _ in runs:
            gen.close()
            if cache is not None:
                cache.close()
            partial.unlink(missing_ok=True)


def run_arm(
    lm: LoadedModel,
    settings: SweepSettings,
    run_dir: Path,
    name: str,
    mib: float,
    share: float,
    prompt: list[int],
    index: int,
    n_arms: int,
    stop: threading.Event | None,
    attempt: int,
) -> Generator[SweepEvent, None, Arm]:
    partial = run_dir / f"{name}.trace.part"
    seconds: list[float] = []
    cancelled = False
    trace: Path | None = None
    try:
        lm.set_cache(_arm_cache(settings, mib, share, partial) if mib > 0 else None)
        params = _arm_sampling(settings, index)
        kv = lm.new_cache()
        last_report = 0.0
        for ev in generate(lm.model, lm.tokenizer, prompt, kv, max_tokens=settings.tokens, params=params,
                           ignore_eos=True, stop=stop):  # fmt: skip
            if isinstance(ev, TokenEvent) and ev.token >= 0:
                seconds.append(ev.seconds)
                now = time.monotonic()
                # The first tokens report at once (the bar moves as soon as the arm runs), then 4 a second.
                if now - last_report >= 0.25 or len(seconds) <= 4 or len(seconds) == settings.tokens:
                    last_report = now
                    yield ArmProgress(index, n_arms, len(seconds), settings.tokens)
            elif isinstance(ev, DoneEvent) and ev.stop_reason == "stopped":
                cancelled = True
        lm.set_cache(None)  # closes the trace
        if cancelled or len(seconds) < settings.tokens:
            raise Cancelled(f"arm {index + 1} stopped after {len(seconds)} tokens")
        if mib > 0:
            trace = run_dir / f"{name}.trace"
            os.replace(partial, trace)
    finally:
        lm.set_cache(None)
        partial.unlink(missing_ok=True)
    return _arm_result(settings, trace, mib, share, prompt, seconds, attempt)


def _arm_result(settings: SweepSettings, trace: Path | None, mib: float, share: float, prompt: list[int],
                seconds: list[float], attempt: int) -> Arm:  # fmt: skip
    """An arm's figures: its timed tokens' pace, and its traffic from replaying its own trace (None: the
    arm ran without a cache, and nothing went through one)."""
    timed = seconds[settings.warmup :]
    if len(timed) < 4:
        raise ValueError(f"--tokens must exceed the warm-up of {settings.warmup} tokens by at least 4")
    half = len(timed) // 2
    hit_rate = upload_gib = cpu_gib = 0.0
    if trace is not None:
        # Token j's time is the forward pass of position n_prompt + j - 1: replay counts from there.
        res = replay(load_routing(trace), mib, share, warmup=len(prompt) + settings.warmup - 1)
        hit_rate, upload_gib, cpu_gib = res.hit_rate, res.upload_gib, res.cpu_gib
    return Arm(
        mib=mib, share=share, tokens=len(timed), ms_per_token=1000 * sum(timed) / len(timed),
        hit_rate=hit_rate, upload_gib=upload_gib, cpu_gib=cpu_gib,
        first_half_tps=half / sum(timed[:half]), second_half_tps=(len(timed) - half) / sum(timed[half:]),
        attempts=attempt, trace=trace.name if trace is not None else "",
    )  # fmt: skip


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# How the arms are measured: a change that moves their speeds makes the kept runs stale. 2: a traced arm
# keeps the cache's token calls (its runs before timed the general path, 20% slower than no cache).
RUNS_MEASURED = 2


def runs_dir(settings: SweepSettings, cache_dir: Path) -> Path:
    """Where the arms of these settings are kept."""
    return cache_dir / "tune" / settings.key()


def forget_runs(settings: SweepSettings, cache_dir: Path) -> None:
    """Drop the kept arms of these settings, so the next sweep measures again."""
    shutil.rmtree(runs_dir(settings, cache_dir), ignore_errors=True)
