"""From measured arms to advice: fit the time model, predict a table of sizes x shares, pick one."""

from __future__ import annotations

import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from moechat.tuner.events import Arm, SweepDone, nice_mib
from moechat.tuner.simulator import Routing, load_routing, replay
from moechat.tuner.time_model import FitError, Observation, TimeModel, fit

TABLE_SHARES = (0.0, 0.5, 0.8, 0.9, 0.95, 0.98)
TABLE_FRACTIONS = (0.05, 0.10, 0.20, 0.30, 0.40, 0.50)
WITHIN = 1.05  # the lowest share within 5% of the fastest


@dataclass(frozen=True)
class Row:
    mib: float
    tps: tuple[float, ...]  # per share of TABLE_SHARES
    hit_rate: tuple[float, ...]
    best: int  # index of the recommended share for this size; -1: no share predicts a positive speed


@dataclass(frozen=True)
class Recommendation:
    mib: float
    share: float
    tps: float
    tps_share0: float  # nan when not known
    all_fit: bool  # every expert fits in the cache
    measured: bool = False  # the fastest measured run, not a prediction (the time model did not fit)
    reason: str = ""  # why no cache, where it is not "the fastest measured"

    @property
    def cache_off(self) -> bool:
        return self.mib <= 0

    def command(self) -> str:
        if self.cache_off:
            return "--moe-cache-mib 0"
        return f"--moe-cache-mib {self.mib:g} --moe-cache-cpu-share {self.share:g}"

    def describe(self) -> str:
        """The advice in words."""
        if self.cache_off:
            return self.reason or f"no expert cache: it is the fastest here ({self.tps:.1f} t/s measured without one)"
        how = "measured" if self.measured else "predicted"
        return f"{self.mib:g} MiB, CPU share {self.share:g} ({self.tps:.1f} t/s {how})"


@dataclass(frozen=True)
class TuneReport:
    model: str
    device: str
    expert_mib: float
    room_mib: float
    arms: tuple[Arm, ...]
    time_model: TimeModel
    shares: tuple[float, ...]
    rows: tuple[Row, ...]
    recommendation: Recommendation
    closed_form_share: float
    warnings: tuple[str, ...]
    off: Arm | None = None  # the run without a cache


def observations(arms: tuple[Arm, ...]) -> list[Observation]:
    return [Observation(a.upload_gib, a.cpu_gib, a.share, a.ms_per_token) for a in arms]


def _predict_row(args: tuple[Routing, float, tuple[float, ...], int, TimeModel]) -> Row:
    routing, mib, shares, warmup, model = args
    tps, hits = [], []
    for share in shares:
        res = replay(routing, mib, share, warmup=warmup)
        tps.append(model.tps(res.upload_gib, res.cpu_gib, share))
        hits.append(res.hit_rate)
    return Row(mib, tuple(tps), tuple(hits), best_share(tps))


def best_share(tps: list[float]) -> int:
    """The lowest share within WITHIN of the fastest, among predictions that are positive speeds (-1: none is)."""
    ms = [1000 / t if math.isfinite(t) and t > 0 else math.inf for t in tps]
    fastest = min(ms, default=math.inf)
    if not math.isfinite(fastest):
        return -1
    return min(i for i, m in enumerate(ms) if m <= WITHIN * fastest)


def fastest_measured(arms: tuple[Arm, ...], full_mib: float) -> Recommendation:
    """The safe advice when the time model cannot be trusted: the fastest run that was measured."""
    best = min(arms, key=lambda a: a.ms_per_token)
    at_zero = [a.tps for a in arms if a.mib == best.mib and a.share == 0]
    return Recommendation(best.mib, best.share, best.tps, at_zero[0] if at_zero else math.nan,
                          all_fit=best.mib >= full_mib, measured=True)  # fmt: skip


def predict_rows(routing: Routing, sizes: list[float], model: TimeModel, shares: tuple[float, ...] = TABLE_SHARES,
                 warmup: int | None = None, workers: int = 0) -> list[Row]:  # fmt: skip
    """Predicted t/s for each size and share, replaying `routing` with a warm cache (half of it is warm-up)."""
    skip = routing.n_tokens // 2 if warmup is None else warmup
    jobs = [(routing, mib, shares, skip, model) for mib in sizes]
    if workers > 1 and len(jobs) > 1:
        # Each size replays independently: spread them over processes (the policy is pure Python).
        with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
            return list(pool.map(_predict_row, jobs))
    return [_predict_row(j) for j in jobs]


def recommend(done: SweepDone, model_name: str, workers: int = 2) -> TuneReport:
    """The report and advice; never fails on what the runs measured (a fit that does not hold is said so)."""
    if done.no_link and done.off is not None:
        return _no_link(done, model_name)
    warnings = []
    try:
        model = fit(observations(done.arms), cpu_is_device=done.device == "cpu")
    except FitError as e:
        warnings.append(f"{e}: no time model, so no predicted table")
        nan = tuple(math.nan for _ in done.arms)
        model = TimeModel(min(a.ms_per_token for a in done.arms), 0.0, 0.0, physical=False, errors=nan)
    routing: Routing | None = None
    for arm in done.arms:
        r = load_routing(Path(done.run_dir) / arm.trace)
        routing = r if routing is None else routing.concat(r)
    assert routing is not None  # a sweep has arms
    full = routing.full_mib()
    cap = done.room_mib
    # The size that holds every expert as a person would type it: whole MiB, rounded up, so the
    # command line never falls a fraction short of it (54.84375 printed as 54.8438 would hold
    # every expert but one slot's worth, after rounding the other way).
    whole = float(math.ceil(full))
    full_typed = whole if whole <= cap else full
    top = min(cap, full_typed)
    calib = sorted({a.mib for a in done.arms})
    sizes = {nice_mib(min(f * done.expert_mib, top)) for f in TABLE_FRACTIONS} | set(calib)
    if cap >= full:
        sizes.add(full_typed)
    sizes_l = sorted(s for s in sizes if 0 < s <= top)
    # An unphysical model predicts nonsense (speeds <= 0, costs that fall with traffic): no table from it.
    rows = predict_rows(routing, sizes_l, model, workers=workers) if model.physical else []
    biggest = rows[-1] if rows else None
    if biggest is not None and biggest.best >= 0:
        rec = Recommendation(biggest.mib, TABLE_SHARES[biggest.best], biggest.tps[biggest.best], biggest.tps[0],
                             all_fit=cap >= full)  # fmt: skip
    else:
        rec = fastest_measured(done.arms, full)
        if not rows and not warnings:
            warnings.append("the fitted time model is not physical (a speed <= 0 or an implausible base), "
                            "so no predicted table")  # fmt: skip
        warnings.append(
            f"the advice is the fastest measured run ({rec.mib:g} MiB, share {rec.share:g}, {rec.tps:.1f} t/s); "
            "measure again on a quieter machine for a full table"
        )
    measured = fastest_measured(done.arms, full)
    if not rec.measured and not rec.all_fit and rec.tps < measured.tps:
        # A prediction below what a run measured is the model's error, not a better setting.
        warnings.append(
            f"the model predicted {rec.tps:.1f} t/s for {rec.mib:g} MiB, share {rec.share:g}, below a measured run "
            f"({measured.mib:g} MiB, share {measured.share:g}: {measured.tps:.1f} t/s): the advice is that run"
        )
        rec = measured
    if done.off is not None and done.off.tps > rec.tps:
        # Every cache costs more than it saves here (the CPU device's lookups, a slow link): say so plainly.
        warnings.append(
            f"no cache is fastest here: without one the run went {done.off.tps:.1f} t/s, the best cache "
            f"{rec.tps:.1f} t/s ({rec.mib:g} MiB, share {rec.share:g}): the advice is to run without a cache"
        )
        rec = Recommendation(0.0, 0.0, done.off.tps, done.off.tps, all_fit=False, measured=True)
    if model.max_error > 0.10:
        warnings.append(f"the runs fit the time model only within {100 * model.max_error:.0f}%: was the machine busy?")
    closed = model.closed_form_share()
    if abs(closed - rec.share) > 0.25 and not rec.all_fit and not rec.measured:
        warnings.append(
            f"the closed form 1 - B_upload/B_cpu suggests share {closed:.2f}, the replayed table {rec.share:g}: "
            "the table accounts for hits and the fixed cost of a CPU part, the closed form does not"
        )
    return TuneReport(model_name, done.device, done.expert_mib, cap, done.arms, model, TABLE_SHARES, tuple(rows),
                      rec, closed, tuple(warnings), done.off)  # fmt: skip


def _no_link(done: SweepDone, model_name: str) -> TuneReport:
    """The CPU device with no link: every run does the same work at the same speed, whatever the size and
    share (their spread is the machine's noise), so there is no time model to fit and no table to predict:
    the advice is no cache, as `--moe-cache-mib auto` leaves it here (a cache there only shows statistics)."""
    off = done.off
    if off is None:
        raise ValueError("no run without a cache to compare the cache's runs with")  # (the caller checks first)
    runs = [*done.arms, off]
    mean = sum(a.ms_per_token for a in runs) / len(runs)
    errors = tuple((mean - a.ms_per_token) / a.ms_per_token for a in done.arms)
    model = TimeModel(mean, 0.0, 0.0, errors=errors)  # the rest of the token is all there is
    spread = max(abs(a.tps / off.tps - 1) for a in done.arms)
    reason = (f"on the CPU device with no link a cache neither saves nor costs time (every run within "
              f"{100 * spread:.0f}% of the run without one, {off.tps:.1f} t/s): its hits and misses are "
              "statistics only, so run without one, as --moe-cache-mib auto does here (--emulate-link-gbps X "
              "tunes for a GPU's link)")  # fmt: skip
    rec = Recommendation(0.0, 0.0, off.tps, off.tps, all_fit=False, measured=True, reason=reason)
    return TuneReport(model_name, done.device, done.expert_mib, done.room_mib, done.arms, model, TABLE_SHARES, (),
                      rec, 0.0, (), off)  # fmt: skip
