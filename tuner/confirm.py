"""The confirm run: the recommended cache setting against the one in use, measured alternately.

A fitted time model predicts; a confirm run measures. Runs alternate (current, recommended,
current, recommended, ...) so that a machine getting busier or quieter weighs on both alike. The
recommendation stands only if its median speed beats the current one's by more than the spread
between repeats of one setting: a gain smaller than the noise is no gain.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from moechat.engine.loader import LoadedModel
from moechat.tuner.events import ArmDone, ArmStarted, ConfirmDone, ConfirmEvent
from moechat.tuner.sweep import SweepSettings, run_arm

CONFIRM_TOKENS = 96  # generated per confirm run
CONFIRM_WARMUP = 16


def confirm(
    lm: LoadedModel,
    settings: SweepSettings,
    current: tuple[float, float],
    recommended: tuple[float, float],
    *,
    repeats: int = 2,
    stop: threading.Event | None = None,
) -> Iterator[ConfirmEvent]:
    """Measure `current` and `recommended` alternately, `repeats` times each; yields progress, then ConfirmDone.

    The runs are not kept (the calibration's are): they answer one question, once."""
    if repeats < 2:
        raise ValueError(f"a confirm run needs at least 2 repeats to see their spread, got {repeats}")
    short = replace(settings, tokens=CONFIRM_TOKENS, warmup=CONFIRM_WARMUP)
    prompt = lm.tokenizer.encode(short.prompt)
    order = [current, recommended] * repeats
    tps: tuple[list[float], list[float]] = ([], [])
    with tempfile.TemporaryDirectory(prefix="moechat-confirm-") as tmp:
        for i, (mib, share) in enumerate(order):
            yield ArmStarted(i, len(order), mib, share)
            arm = yield from run_arm(lm, short, Path(tmp), f"confirm-{i}", mib, share, prompt, i, len(order), stop, 1)
            tps[i % 2].append(arm.tps)
            yield ArmDone(i, len(order), arm, cached=False)
    yield ConfirmDone(current, recommended, tuple(tps[0]), tuple(tps[1]))
