"""What a calibration sweep and a confirm run report, without torch: the chat app's UI process reads
these while the engine process measures."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

# The sweep's parameters, declared once: `moechat tune`, the wizard and the engine's sweep all read them here.
CALIB_SHARES = (0.0, 0.5, 0.95)  # the CPU shares each of the two calibration sizes runs at
N_ARMS = 2 * len(CALIB_SHARES) + 1  # two sizes x the shares, then one run without a cache
SWEEP_TOKENS = 256  # tokens generated per run
SWEEP_WARMUP = 32  # first tokens of a run, not timed
SWEEP_MAX_CTX = 4096  # the context a sweep's runs load with, at most (a run fills a few hundred positions)


def setting_words(mib: float, share: float) -> str:
    """A cache setting as the sweep's and the confirm run's lines say it."""
    return "no cache" if mib <= 0 else f"cache {mib:g} MiB, CPU share {share:g}"


class Cancelled(Exception):
    """The sweep was stopped between tokens."""


@dataclass(frozen=True)
class Arm:
    """One measured run."""

    mib: float
    share: float
    tokens: int  # timed tokens
    ms_per_token: float
    hit_rate: float
    upload_gib: float  # per timed token
    cpu_gib: float
    first_half_tps: float
    second_half_tps: float
    attempts: int
    trace: str  # file name in the run directory ("": cache off, no routing through a cache to trace)

    @property
    def cache_off(self) -> bool:
        return self.mib <= 0

    @property
    def tps(self) -> float:
        return 1000.0 / self.ms_per_token


@dataclass(frozen=True)
class ArmStarted:
    index: int  # 0-based
    n_arms: int
    mib: float
    share: float


@dataclass(frozen=True)
class ArmProgress:
    index: int
    n_arms: int
    tokens_done: int
    tokens_total: int


@dataclass(frozen=True)
class ArmDone:
    index: int
    n_arms: int
    arm: Arm
    cached: bool  # reused from an earlier sweep


@dataclass(frozen=True)
class SweepDone:
    run_dir: Path
    arms: tuple[Arm, ...]
    expert_mib: float
    room_mib: float  # largest cache the device has room for (or --max-mib)
    device: str
    off: Arm | None = None  # the same run without a cache, measured beside the arms
    # The CPU device with no emulated link: an upload is a copy in the same memory, a hit and a miss the
    # same kernels on the same bytes, so no size or share changes the speed (nothing to fit or predict).
    no_link: bool = False


@dataclass(frozen=True)
class NoiseCheck:
    """Before the runs: one short generation timed in parts. Parts that differ by more than `bound`
    mean other work comes and goes on the machine: runs measured now would measure it too."""

    tps: tuple[float, ...]  # each part's tokens per second, in order
    bound: float  # the largest relative spread taken as steady

    @property
    def spread(self) -> float:
        """(fastest - slowest) / slowest part."""
        return max(self.tps) / min(self.tps) - 1 if self.tps and min(self.tps) > 0 else float("inf")

    @property
    def steady(self) -> bool:
        return self.spread <= self.bound

    def describe(self) -> str:
        parts = ", ".join(f"{t:.1f}" for t in self.tps)
        return (
            f"{len(self.tps)} parts of a short run went at {parts} tokens/s: they differ by "
            f"{100 * self.spread:.0f}%" + (f", more than {100 * self.bound:.0f}%" if not self.steady else "")
        )


SweepEvent = NoiseCheck | ArmStarted | ArmProgress | ArmDone | SweepDone


@dataclass(frozen=True)
class ConfirmDone:
    current: tuple[float, float]  # (MiB, CPU share)
    recommended: tuple[float, float]
    current_tps: tuple[float, ...]  # one per repeat, in the order run
    recommended_tps: tuple[float, ...]

    @property
    def spread(self) -> float:
        """t/s between repeats of one setting: the larger range of the two."""
        return max(max(v) - min(v) for v in (self.current_tps, self.recommended_tps))

    @property
    def gain(self) -> float:
        return statistics.median(self.recommended_tps) - statistics.median(self.current_tps)

    @property
    def wins(self) -> bool:
        """The recommendation is faster by more than the repeats vary."""
        return self.gain > self.spread


ConfirmEvent: TypeAlias = SweepEvent | ConfirmDone


def nice_mib(x: float) -> float:
    """Round a cache size down to something a person would type: 64 MiB steps when large."""
    if x >= 256:
        return float(int(x) // 64 * 64)
    if x >= 1:
        return float(f"{x:.3g}")
    return float(f"{x:.2g}")
