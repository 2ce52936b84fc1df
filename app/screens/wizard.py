"""The tuning wizard: the calibration sweep in a cancellable worker, then the advice.

Cancel (Esc) stops the sweep between tokens and returns with the session's cache unchanged;
`a` applies the recommendation to the running session, `s` saves it to config.toml, `m` measures
every run again (runs kept from earlier tunings, the wizard's or `moechat tune`'s, are dropped).
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import ClassVar

from moechat.app.engine_api import local
from moechat.app.messages import CacheApplied, ConfirmUpdate, SweepFailed, SweepUpdate, TuneReady
from moechat.app.screens.host import ScreenHost, host_of
from moechat.app.tuned import save_tuned
from moechat.tuner.events import (
    N_ARMS,
    SWEEP_TOKENS,
    ArmDone,
    ArmProgress,
    ArmStarted,
    Cancelled,
    ConfirmDone,
    NoiseCheck,
    SweepDone,
    setting_words,
)
from moechat.tuner.recommend import TuneReport
from moechat.tuner.report import cpu_speed, duration, error_bar, upload_speed, work_left
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, ProgressBar, Static

# The one rule of Apply and Save, shown on the screen.
KEEP_RULE = (
    "a: apply the recommendation now and keep it for this model; s: keep it for this model's next start. "
    "Either only once its confirm run has beaten the setting in use. Kept settings apply to this model "
    "only (config.toml stays your defaults for every model; flags and MOECHAT_* variables still win)."
)


class TuneWizard(Screen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel / back", priority=True),
        Binding("a", "apply", "Apply"),
        Binding("s", "save", "Keep for this model"),
        Binding("m", "measure_again", "Measure again"),
        Binding("w", "check_again", "Check the noise again", show=False),
        Binding("g", "go_on", "Go on despite the noise", show=False),
    ]
    DEFAULT_CSS = """
    TuneWizard VerticalScroll { padding: 0 2; }
    TuneWizard .arm { height: 1; }
    TuneWizard DataTable { height: auto; max-height: 14; margin: 1 0; }
    #advice { text-style: bold; margin: 1 0; }
    """

    def __init__(self, tokens: int = SWEEP_TOKENS) -> None:
        super().__init__()
        self.tokens = tokens
        self.fresh = False  # True after "measure again": the sweep drops the kept runs
        self.stop = threading.Event()
        self.report: TuneReport | None = None
        self.verdict: ConfirmDone | None = None  # the confirm run's, once measured
        self._advice = ""
        self.running = False
        self._timing: tuple[float, int] | None = None  # (start, tokens measured by then) of this sweep's runs
        self._arm_tokens: dict[int, int] = {}  # tokens measured so far by each run this sweep measures
        self.check = True  # the next sweep checks for noise first (off once the user chose to go on)
        self.noisy: NoiseCheck | None = None  # a noise check that stopped the sweep, until the user answers

    @property
    def moechat(self) -> ScreenHost:
        return host_of(self)

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(
                f"Tuning measures {N_ARMS} runs, each generating {self.tokens} tokens with one expert-cache size and "
                "one CPU share (2 sizes x 3 shares), and one without a cache: the setting every cache must beat. A "
                "time model fitted to the cache runs, replayed over the routing they recorded, predicts every other "
                "size and share.",
                id="intro",
                markup=False,
            )
            yield Static(self._first_estimate(), id="estimate", markup=False)
            yield Static("time left: measured once the first run is under way", id="eta", markup=False)
            with Vertical(id="arms"):
                for i in range(N_ARMS):
                    yield Static(f"run {i + 1}/{N_ARMS}: waiting", id=f"arm-label-{i}", classes="arm")
                    yield ProgressBar(total=self.tokens, show_eta=False, id=f"arm-{i}")
            yield Static("", id="machine", markup=False)
            yield DataTable(id="runs")
            yield DataTable(id="table")
            yield Static("", id="advice", markup=False)
            yield Static(KEEP_RULE, id="rule", markup=False)
        yield Footer()

    def _first_estimate(self) -> str:
        """Before any run: the sweep's length at the decode speed of this session's recent replies."""
        rates = [r["gen_tps"] for r in self.moechat.session.replies[-3:] if r.get("gen_tps")]
        if not rates:
            return "estimate: after the first run's first tokens (no reply in this session to go by yet)"
        rate = sum(rates) / len(rates)
        return (f"estimate: {duration(N_ARMS * self.tokens / rate)} for {N_ARMS} runs at {rate:.1f} tokens/s "
                "(this session's replies; runs kept from an earlier tuning are reused)")  # fmt: skip

    def on_mount(self) -> None:
        # The sweep runs the engine's cache at other sizes, then rebuilds the session's: what the
        # session's cache counted so far stays in the session's totals.
        self.moechat.session.cache_rebuilt()
        self.running = True
        self.sweep()

    @work(thread=True, exclusive=True, group="engine")
    def sweep(self) -> None:
        try:
            with self.moechat.engine_lock:
                self._sweep()
        except Cancelled as e:
            self.post_message(SweepFailed(str(e), cancelled=True))
        except Exception as e:  # shown on the screen; the session keeps its cache
            self.post_message(SweepFailed(f"{type(e).__name__}: {e}", cancelled=False))

    def _sweep(self) -> None:
        engine = local(self.moechat.engine, "tuning")
        done = None
        for ev in engine.sweep(self.stop, None, self.tokens, self.fresh, self.check):
            self.post_message(SweepUpdate(ev))
            if isinstance(ev, SweepDone):
                done = ev
        if done is not None and not self.stop.is_set():  # cancelled: no replay keeps the engine busy
            self.post_message(TuneReady(engine.recommend(done)))

    def on_sweep_update(self, msg: SweepUpdate) -> None:
        ev = msg.event
        if isinstance(ev, NoiseCheck):
            if ev.steady:
                self.query_one("#eta", Static).update(f"the machine looks steady: {ev.describe()}")
                return
            self.running, self.noisy = False, ev
            self.query_one("#eta", Static).update("stopped before measuring: the machine looks busy")
            self.query_one("#advice", Static).update(
                f"the machine looks busy: {ev.describe()}. Runs measured now would measure that other work "
                "too.  w: check again (after closing what runs beside moechat), g: go on anyway, Esc: back"
            )
        elif isinstance(ev, ArmStarted):
            self.query_one(f"#arm-label-{ev.index}", Static).update(
                f"run {ev.index + 1}/{ev.n_arms}: {setting_words(ev.mib, ev.share)}"
            )
        elif isinstance(ev, ArmProgress):
            self.query_one(f"#arm-{ev.index}", ProgressBar).update(total=ev.tokens_total, progress=ev.tokens_done)
            self._estimate(ev)
        elif isinstance(ev, ArmDone):
            a = ev.arm
            self.query_one(f"#arm-{ev.index}", ProgressBar).update(total=1, progress=1)
            self.query_one(f"#arm-label-{ev.index}", Static).update(
                f"run {ev.index + 1}/{ev.n_arms}: {setting_words(a.mib, a.share)}: {a.tps:.1f} t/s"
                + ("" if a.cache_off else f", hits {100 * a.hit_rate:.0f}%")
                + (" (reused from an earlier tuning)" if ev.cached else "")
            )

    def _estimate(self, ev: ArmProgress) -> None:
        """Time left from the pace so far: the tokens still to generate at this sweep's tokens per second."""
        now = time.monotonic()
        self._arm_tokens[ev.index] = ev.tokens_done
        measured = sum(self._arm_tokens.values())
        if self._timing is None:
            self._timing = (now, measured)
            return
        start, first = self._timing
        if measured - first < 8:
            return
        rate = (measured - first) / (now - start)
        left, _ = work_left(self._arm_tokens, ev.n_arms, ev.tokens_total)
        self.query_one("#eta", Static).update(f"time left: about {duration(left / rate)} at {rate:.1f} tokens/s")

    def on_tune_ready(self, msg: TuneReady) -> None:
        self.running = False
        self.query_one("#eta", Static).update("done")
        self.report = r = msg.report
        m = r.time_model
        self.query_one("#machine", Static).update(
            f"machine: {upload_speed(m)}, {cpu_speed(m)}, rest {m.base:.2f} ms/token; "
            f"fit within {100 * m.max_error:.1f}%" + "".join(f"\nwarning: {w}" for w in r.warnings)
        )
        runs = self.query_one("#runs", DataTable)
        runs.add_columns("cache MiB", "share", "t/s", "hits")
        for a in r.arms:
            runs.add_row(f"{a.mib:g}", f"{a.share:g}", f"{a.tps:.1f}", f"{100 * a.hit_rate:.0f}%")
        if r.off is not None:
            runs.add_row("off", "-", f"{r.off.tps:.1f}", "-")
        table = self.query_one("#table", DataTable)
        table.add_columns("cache MiB", *[f"share {s:g}" for s in r.shares])
        top = max((max(row.tps) for row in r.rows), default=0.0)
        for row in r.rows:
            cells: list[str | Text] = [f"{row.mib:g}"]
            for i, tps in enumerate(row.tps):
                # A heat map in the 16 basic colours: the faster, the greener.
                style = (
                    "bold reverse green"
                    if i == row.best
                    else ("green" if tps > 0.9 * top else "yellow" if tps > 0.7 * top else "red")
                )
                cells.append(Text(f"{tps:.1f}", style=style))
            table.add_row(*cells)
        rec = r.recommendation
        how = "measured" if rec.measured else "predicted"
        noisy = " (the runs look noisy: m measures them again)" if r.warnings else ""
        keys = "  -  a: apply now and keep for this model, s: keep only, m: measure again, Esc: back"
        if rec.cache_off:
            self._advice = f"recommended: {rec.describe()}{noisy}{keys}"
        else:
            bar = error_bar(rec.tps, r.time_model, rec.measured)
            self._advice = f"recommended: {rec.command()} ({rec.tps:.1f}{bar} t/s {how}){noisy}{keys}"
        current, target = self.moechat.cache_in_effect, (rec.mib, rec.share)
        if target == current:
            self._show_advice("this is the setting in use: nothing to confirm")
            return
        # A prediction is checked before it is trusted: the two settings measured alternately.
        self.running = True
        self._show_advice(f"confirming against the setting in use ({current[0]:g} MiB, share {current[1]:g})...")
        self.confirm_run(current, target)

    def _show_advice(self, line: str) -> None:
        self.query_one("#advice", Static).update(f"{self._advice}\n{line}")

    @work(thread=True, exclusive=True, group="engine")
    def confirm_run(self, current: tuple[float, float], target: tuple[float, float]) -> None:
        try:
            with self.moechat.engine_lock:
                for ev in local(self.moechat.engine, "tuning").confirm(self.stop, current, target):
                    self.post_message(ConfirmUpdate(ev))
        except Cancelled as e:
            self.post_message(SweepFailed(str(e), cancelled=True))
        except Exception as e:  # shown on the screen; the session keeps its cache
            self.post_message(SweepFailed(f"confirm run: {type(e).__name__}: {e}", cancelled=False))

    def on_confirm_update(self, msg: ConfirmUpdate) -> None:
        ev = msg.event
        if isinstance(ev, ArmStarted):
            which = "in use" if ev.index % 2 == 0 else "recommended"
            self._show_advice(f"confirming: run {ev.index + 1}/{ev.n_arms}, the {which} setting "
                              f"({setting_words(ev.mib, ev.share)})")  # fmt: skip
        elif isinstance(ev, ConfirmDone):
            self.running = False
            self.verdict = ev
            rec, cur = statistics.median(ev.recommended_tps), statistics.median(ev.current_tps)
            if ev.wins:
                self._show_advice(f"confirmed: {rec:.1f} t/s against {cur:.1f} in use, a gain of {ev.gain:.1f} "
                                  f"beyond the repeats' spread of {ev.spread:.1f}")  # fmt: skip
            else:
                self._show_advice(f"not confirmed: {rec:.1f} t/s against {cur:.1f} in use, a gain of "
                                  f"{ev.gain:+.1f} within the repeats' spread of {ev.spread:.1f}: keep the setting "
                                  "in use")  # fmt: skip

    def on_sweep_failed(self, msg: SweepFailed) -> None:
        self.running = False
        if msg.cancelled:
            return
        self.query_one("#advice", Static).update(f"the sweep failed: {msg.error}")
        self.notify(msg.error, severity="error")

    def action_cancel(self) -> None:
        if self.running:
            self.stop.set()  # the worker stops between tokens; the engine restores the session's cache
            self.notify("tuning cancelled; settings unchanged")
        self.dismiss(False)

    def action_check_again(self) -> None:
        """After a noisy check: check again, then measure if the machine is steady."""
        if self.noisy is not None and not self.running:
            self._sweep_again(fresh=self.fresh, check=True)

    def action_go_on(self) -> None:
        """After a noisy check: measure anyway."""
        if self.noisy is not None and not self.running:
            self._sweep_again(fresh=self.fresh, check=False)

    def action_measure_again(self) -> None:
        """Drop the kept runs and sweep again from the first run."""
        if self.running:
            self.notify("tuning is under way", severity="warning")
            return
        self._sweep_again(fresh=True, check=True)

    def _sweep_again(self, fresh: bool, check: bool) -> None:
        self.report, self.verdict, self.noisy, self._timing, self._arm_tokens = None, None, None, None, {}
        self.fresh, self.check = fresh, check
        self.stop = threading.Event()
        for i in range(N_ARMS):
            self.query_one(f"#arm-label-{i}", Static).update(f"run {i + 1}/{N_ARMS}: waiting")
            self.query_one(f"#arm-{i}", ProgressBar).update(total=self.tokens, progress=0)
        for table in self.query(DataTable):
            table.clear(columns=True)
        for name in ("#machine", "#advice"):
            self.query_one(name, Static).update("")
        self.query_one("#eta", Static).update("time left: measured once the first run is under way")
        self.running = True
        self.sweep()

    def _refusal(self) -> str | None:
        """Why the recommendation cannot be applied or kept now (KEEP_RULE), or None."""
        if self.report is None or self.running:
            return "wait for the recommendation and its confirm run"
        if self.verdict is not None and not self.verdict.wins:
            return "the recommendation did not beat the setting in use by more than the noise"
        return None

    def action_apply(self) -> None:
        why = self._refusal()
        if why is not None or self.report is None:
            self.notify(f"not applied: {why}", severity="warning")
            return
        rec = self.report.recommendation
        self.apply_cache(rec.mib, rec.share)

    @work(thread=True, exclusive=True, group="engine")
    def apply_cache(self, mib: float, share: float) -> None:
        try:
            with self.moechat.engine_lock:
                local(self.moechat.engine, "changing the cache").set_cache(mib, share)
            self.post_message(CacheApplied(mib, share, None))
        except Exception as e:
            self.post_message(CacheApplied(mib, share, str(e)))

    def on_cache_applied(self, msg: CacheApplied) -> None:
        if msg.error:
            self.notify(f"could not apply: {msg.error}", severity="error")
            return
        self.moechat.apply_cache_settings(msg.mib, msg.share)
        # Applied for this session and kept for this model's next ones (not for other models).
        where = self._save(msg.mib, msg.share)
        saved = f"; saved to {where}" if where else ""
        self.notify(f"applied: cache {msg.mib:g} MiB, share {msg.share:g}{saved}")
        self.dismiss(True)

    def _save(self, mib: float, share: float) -> Path | None:
        info = self.moechat.engine.info
        try:
            return save_tuned(info.sha256_head, info.name, mib, share, self.moechat.paths.data)
        except (OSError, ValueError) as e:
            self.notify(f"could not save: {e}", severity="error")
            return None

    def action_save(self) -> None:
        why = self._refusal()
        if why is not None or self.report is None:
            self.notify(f"not saved: {why}", severity="warning")
            return
        rec = self.report.recommendation
        path = self._save(rec.mib, rec.share)
        if path is not None:
            self.notify(f"kept for this model's next start in {path} (a applies it now too)")
