"""Time per token from the expert traffic: fitted to measured runs, used to predict the rest.

    ms/token = base + up_ms * upload GiB + cpu_ms * CPU GiB + split * [share > 0] + overlap * min(upload, CPU)

`up_ms` and `cpu_ms` are milliseconds per GiB (1000 / speed in GiB/s); `split` is the fixed cost of
having a CPU part at all; `overlap` (usually negative) is the time saved because the CPU part runs
while the device uploads. Fitted by least squares (numpy); a fit that is not physical (a speed
that is not positive, a base that is not a fair part of the fastest run, an overlap hiding more
than the cheaper path) falls back to the model without the overlap term, and a negative split
(noise) drops that term. When the device is the CPU itself (`cpu_is_device`), a miss computed "on
the CPU" is the same work as a hit: the model is `base + up * upload GiB` wherever that fits the runs
within MAX_FIT_ERROR; elsewhere a CPU cost that fits at or below zero is taken as zero, not as a
sign of a busy machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from moechat.engine.cache.policy import closed_form_share

TERMS = ("base", "up", "cpu", "split", "overlap")
MAX_FIT_ERROR = 0.10  # a worse fit means the machine was busy, like the seed


@dataclass(frozen=True)
class Observation:
    """One measured run: its traffic per token and its time per token."""

    upload_gib: float
    cpu_gib: float
    share: float
    ms_per_token: float


@dataclass(frozen=True)
class TimeModel:
    base: float
    up: float  # ms per GiB uploaded
    cpu: float  # ms per GiB computed on the CPU
    split: float = 0.0
    overlap: float = 0.0
    physical: bool = True
    errors: tuple[float, ...] = ()  # relative error of the fit per run
    # Relative error of each run's prediction by the model fitted without it (leave-one-out): how
    # far off a prediction for a setting not measured can be. Runs whose leave-one-out fit fails
    # (the rest do not determine the model) are left out.
    loo_errors: tuple[float, ...] = ()

    def ms(self, upload_gib: float, cpu_gib: float, share: float) -> float:
        return (self.base + self.up * upload_gib + self.cpu * cpu_gib + (self.split if share > 0 else 0.0)
                + self.overlap * min(upload_gib, cpu_gib))  # fmt: skip

    def tps(self, upload_gib: float, cpu_gib: float, share: float) -> float:
        return 1000.0 / self.ms(upload_gib, cpu_gib, share)

    @property
    def upload_gibps(self) -> float:
        return 1000.0 / self.up if self.up > 0 else float("inf")

    @property
    def cpu_gibps(self) -> float:
        return 1000.0 / self.cpu if self.cpu > 0 else float("inf")

    @property
    def cpu_free(self) -> bool:
        """CPU-computed misses cost nothing beyond a hit (fitted so on the CPU device)."""
        return self.cpu == 0.0

    @property
    def max_error(self) -> float:
        return max((abs(e) for e in self.errors), default=0.0)

    @property
    def spread(self) -> float:
        """The predictions' relative error bar: the RMS of the leave-one-out errors (nan: none)."""
        if not self.loo_errors:
            return float("nan")
        return float(np.sqrt(np.mean(np.square(self.loo_errors))))

    @property
    def trustworthy(self) -> bool:
        return self.physical and self.max_error <= MAX_FIT_ERROR

    def closed_form_share(self) -> float:
        """s* ~ 1 - B_upload / B_cpu: the CPU should take misses only when it reads experts faster than the link."""
        if self.up > 0 and self.cpu_free:
            return 1.0  # uploads cost time and CPU misses do not: the CPU takes them all
        if not (self.up > 0 and self.cpu > 0):
            return 0.0
        return closed_form_share(self.upload_gibps, self.cpu_gibps)  # the engine's auto share, on fitted speeds


class FitError(ValueError):
    """The runs do not determine the time model."""


def _row(o: Observation) -> list[float]:
    return [1.0, o.upload_gib, o.cpu_gib, float(o.share > 0), min(o.upload_gib, o.cpu_gib)]


def fit(runs: Sequence[Observation], cpu_is_device: bool = False) -> TimeModel:
    """The time model of the runs, with its fit errors and its leave-one-out errors."""
    model = _fit(runs, cpu_is_device)
    loo = []
    if len(runs) > 3:
        for i, o in enumerate(runs):
            try:
                other = _fit([r for j, r in enumerate(runs) if j != i], cpu_is_device)
            except FitError:
                continue
            loo.append((other.ms(o.upload_gib, o.cpu_gib, o.share) - o.ms_per_token) / o.ms_per_token)
    return replace(model, loo_errors=tuple(loo))


def _fit(runs: Sequence[Observation], cpu_is_device: bool) -> TimeModel:
    if len(runs) < 3:
        raise FitError(f"the time model needs at least 3 runs, got {len(runs)}")
    a_full = np.array([_row(o) for o in runs], dtype=np.float64)  # [R, 5]
    y = np.array([o.ms_per_token for o in runs], dtype=np.float64)  # [R]

    def solve(terms: list[str]) -> dict[str, float]:
        cols = [TERMS.index(t) for t in terms]
        a = a_full[:, cols]
        if np.linalg.matrix_rank(a) < len(cols):
            if "split" in terms:
                return solve([t for t in terms if t != "split"])
            raise FitError("the runs do not determine the time model (too little variation in traffic)")
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        out = dict(zip(terms, (float(c) for c in coef), strict=True))
        if out.get("split", 0.0) < 0:  # a negative fixed cost is noise
            return solve([t for t in terms if t != "split"])
        return out

    def physical(m: dict[str, float], cpu_free: bool = False) -> bool:
        up, cpu, overlap = m.get("up", 0.0), m.get("cpu", 0.0), m.get("overlap", 0.0)
        # Each path costs time (the CPU's may not, where `cpu_free`), the rest of the token is a good
        # part of the fastest run, and running the two paths together hides at most the cheaper one.
        paths = up > 0 and (cpu_free or (cpu > 0 and -overlap <= min(up, cpu)))
        return paths and m.get("base", 0.0) >= 0.2 * float(y.min())

    def general() -> TimeModel:
        m = solve(list(TERMS))
        ok = physical(m)
        if not ok:
            m = solve([t for t in TERMS if t != "overlap"])
            ok = physical(m)
        if not ok and cpu_is_device and m.get("cpu", 0.0) <= 0:
            m = solve(["base", "up", "split"])  # CPU misses free: no CPU cost, nothing for it to overlap
            ok = physical(m, cpu_free=True)
        return _model(m, runs, y, ok)

    if cpu_is_device:
        # A miss computed "on the CPU" and a hit are the same kernels on the same cores and bytes (the
        # slots are the host copy): time is the rest of the token plus the link's, nothing to split
        # or overlap. Two terms are what six noisy runs can pin down; the general model only where
        # it fits and two do not (on a busy machine neither may fit: the two terms stay).
        m2 = solve(["base", "up"])
        two = _model(m2, runs, y)
        if physical(m2, cpu_free=True):
            if two.max_error <= MAX_FIT_ERROR:
                return two
            other = general()
            return other if other.trustworthy else two
    return general()


def _model(m: dict[str, float], runs: Sequence[Observation], y: np.ndarray, physical: bool = True) -> TimeModel:
    base, up, cpu, split, overlap = (m.get(t, 0.0) for t in TERMS)
    model = TimeModel(base, up, cpu, split, overlap, physical=physical)
    errors = tuple((model.ms(o.upload_gib, o.cpu_gib, o.share) - o.ms_per_token) / o.ms_per_token for o in runs)
    return replace(model, errors=errors)


@dataclass(frozen=True)
class Forecast:
    """Decode speed predicted before any run is measured (`forecast`), and the traffic it assumes per token."""

    tps: float
    hit_rate: float
    upload_mib: float  # per token
    cpu_mib: float  # per token

    def line(self) -> str:
        return (f"predicted decode: {self.tps:.1f} t/s (from the speeds measured; routing assumed even "
                f"over the experts: {self.hit_rate:.0%} hits, {self.upload_mib:.1f} MiB uploaded and "
                f"{self.cpu_mib:.1f} MiB on the CPU per token; a tuning run measures the real ones)")  # fmt: skip


def forecast(read_bytes: float, expert_bytes: Sequence[int], k: int, n_expert: int, cache_bytes: float,
             share: float, *, link_gbps: float, cpu_gbps: float, device_gbps: float = 0.0,
             token_ms: float = 0.0) -> Forecast:  # fmt: skip
    """The time model's t/s for a cache of `cache_bytes` spread evenly over the MoE layers (`expert_bytes`: one
    expert's bytes per layer), before any run has measured its terms. Routing is taken as even over the
    experts, so the hit rate is the share of each layer's experts in slots; of the misses, `share` is
    computed on the CPU at `cpu_gbps`, the rest uploaded at `link_gbps`.

    On a device (`device_gbps`): it reads `read_bytes` of dense weights, the hits and the uploaded experts at
    that speed, and the CPU's part overlaps the uploads (the longer of the two counts). On the CPU device
    (`token_ms`, a measured token with the cache off): every expert runs on the CPU wherever it is, so a
    token takes that plus the uploads' time over the emulated link."""
    layers = len(expert_bytes)
    slots = [min(n_expert, int(cache_bytes / layers // b)) if b else n_expert for b in expert_bytes]
    hits = sum(k * s / n_expert * b for s, b in zip(slots, expert_bytes, strict=True))
    misses = sum(k * b for b in expert_bytes) - hits
    upload, cpu = misses * (1 - share), misses * share
    if token_ms:  # the CPU device: the same work wherever an expert runs, plus the link's time
        ms = token_ms + 1000 * upload / (link_gbps * 1e9)
    else:  # the CPU's part runs on its worker while the device uploads and computes the rest
        device_ms = 1000 * (read_bytes + hits + upload) / (device_gbps * 1e9)
        ms = device_ms + max(1000 * upload / (link_gbps * 1e9), 1000 * cpu / (cpu_gbps * 1e9))
    hit_rate = hits / (hits + misses) if hits + misses else 1.0
    return Forecast(1000 / ms, hit_rate, upload / 2**20, cpu / 2**20)
