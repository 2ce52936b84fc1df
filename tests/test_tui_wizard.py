"""The tuning wizard: estimate, measure, confirm, apply or keep, cancel, a busy machine."""

from __future__ import annotations

from pathlib import Path

import pytest
from moechat.app.screens.wizard import TuneWizard
from moechat.app.tuned import read_tuned, tuned_path
from testkit.fake_engine import FakeEngine
from testkit.pilot import WORDS, drawn, make_app, on_screen, ready, say, until
from textual.widgets import DataTable, Static


async def test_wizard_apply_and_save(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, TuneWizard) and app.screen.report is not None)
        wizard = app.screen
        assert "recommended: --moe-cache-mib 1.5 --moe-cache-cpu-share 0.9" in str(
            wizard.query_one("#advice", Static).content)  # fmt: skip
        assert "this model only" in str(wizard.query_one("#rule", Static).content)  # the one rule, on screen
        await until(pilot, lambda: wizard.verdict is not None)
        kept = tuned_path(engine.info.sha256_head, app.paths.data)
        await pilot.press("s")  # kept for this model's next start, not applied
        await until(pilot, lambda: kept.is_file())
        assert read_tuned(engine.info.sha256_head, app.paths.data) == (
            {"moe_cache_mib": 1.5, "moe_cache_cpu_share": 0.9},
            kept,
        )
        assert not engine.set_cache_calls and not app.config_path.exists()  # config.toml: the user's, untouched
        kept.unlink()
        await pilot.press("a")  # applied now, and kept for this model
        await until(pilot, lambda: app.screen is screen)
        assert engine.set_cache_calls == [(1.5, 0.9)] and engine.cache() == (1.5, 0.9)
        assert app.settings.moe_cache_mib == 1.5
        assert kept.is_file() and not app.config_path.exists()


@pytest.mark.parametrize(
    ("script", "wins"), [(((70.0, 71.0), (84.0, 85.5)), True), (((80.0, 84.0), (82.0, 85.0)), False)]
)
async def test_wizard_confirms_the_recommendation_before_applying_it(
    tmp_path: Path, script: tuple[tuple[float, ...], tuple[float, ...]], wins: bool
) -> None:
    """After the fit the wizard measures the recommended setting against the one in use, alternately;
    a gain within the spread between repeats is no gain: then Apply changes nothing."""
    engine = FakeEngine(WORDS)
    engine.confirm_tps = script
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, TuneWizard) and app.screen.verdict is not None)
        wizard = app.screen
        assert engine.confirms == [((1.0, 0.0), (1.5, 0.9))]  # in use, then the recommendation
        advice = str(wizard.query_one("#advice", Static).content)
        if wins:
            assert "confirmed: 84.8 t/s against 70.5 in use, a gain of 14.2 beyond the repeats' spread of 1.5" in advice
        else:
            assert "not confirmed: 83.5 t/s against 82.0 in use, a gain of +1.5 within the repeats' spread of 4.0" \
                in advice  # fmt: skip
        kept = tuned_path(engine.info.sha256_head, app.paths.data)
        if not wins:  # one rule for both: neither applies nor keeps an unconfirmed recommendation
            await pilot.press("s")
            await pilot.pause(0.2)
            assert not kept.exists()
        await pilot.press("a")
        if wins:
            await until(pilot, lambda: app.screen is screen)
            assert engine.set_cache_calls == [(1.5, 0.9)] and kept.is_file()
        else:
            await pilot.pause(0.2)
            assert app.screen is wizard and engine.set_cache_calls == [] and not app.config_path.exists()


async def test_wizard_stops_on_a_busy_machine_and_offers_to_check_again_or_go_on(tmp_path: Path) -> None:
    """A noise check comes first; parts that differ beyond its bound stop the sweep before any run,
    with the choice on screen: w checks again, g measures anyway."""
    engine = FakeEngine(WORDS)
    engine.noise = [(12.0, 41.0, 40.0), (30.0, 45.0, 44.0)]  # busy, then busy again; a third check is steady
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, TuneWizard) and app.screen.noisy is not None)
        wizard = app.screen
        assert isinstance(wizard, TuneWizard)
        advice = wizard.query_one("#advice", Static)
        assert "the machine looks busy: 3 parts of a short run went at 12.0, 41.0, 40.0 tokens/s" in drawn(advice)
        assert "differ by 242%, more than 25%" in drawn(advice) and "w: check again" in drawn(advice)
        assert wizard.report is None and engine.checks == [True]
        await pilot.press("w")
        await until(pilot, lambda: len(engine.checks) == 2 and wizard.noisy is not None and not wizard.running)
        assert "12.0" not in drawn(advice) and "30.0, 45.0, 44.0" in drawn(advice) and wizard.report is None
        await pilot.press("g")  # go on: measured without a check
        await until(pilot, lambda: wizard.report is not None)
        assert engine.checks == [True, True, False] and wizard.noisy is None
        assert "recommended:" in drawn(advice)
        await pilot.press("m")  # measuring again checks again (steady now)
        await until(pilot, lambda: len(engine.checks) == 4 and wizard.report is not None)
        assert engine.checks[-1] is True
        assert str(wizard.query_one("#eta", Static).content) == "done"


@pytest.mark.slow
async def test_wizard_says_what_it_measures_and_how_long_is_left(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS, sweep_delay=0.1)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, TuneWizard) and bool(app.screen.query("#eta")))
        wizard = app.screen
        eta = wizard.query_one("#eta", Static)
        await until(pilot, lambda: str(eta.content).startswith("time left: about"))
        left = str(eta.content)
        assert "tokens/s" in left and (" s " in left or left.split()[-4] == "s")
        await until(pilot, lambda: wizard.report is not None)
        assert str(eta.content) == "done"
        labels = [str(w.content) for w in wizard.query(".arm")]
        assert labels[0].startswith("run 1/7: cache 0.5 MiB, CPU share 0: 100.0 t/s")
        assert labels[-1] == "run 7/7: no cache: 20.0 t/s"  # the run every cache must beat


@pytest.mark.slow
async def test_wizard_estimates_before_it_starts_and_measures_again(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS, sweep_delay=0.02)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hello")  # a reply: the session now has a decode speed
        rate = app.session.replies[-1]["gen_tps"]
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, TuneWizard) and bool(app.screen.query("#estimate")))
        wizard = app.screen
        first = str(wizard.query_one("#estimate", Static).content)
        assert first.startswith("estimate: ") and f"7 runs at {rate:.1f} tokens/s" in first, first
        await until(pilot, lambda: wizard.report is not None)
        before = wizard.report
        await pilot.press("m")  # drop the kept runs and run the sweep again
        await until(pilot, lambda: wizard.report is not None and wizard.report is not before)
        assert engine.sweeps == [False, True]
        assert "recommended:" in str(wizard.query_one("#advice", Static).content)
        assert len(wizard.query_one("#runs", DataTable).rows) == 7  # one table, not the old one twice


async def test_wizard_says_plainly_when_no_cache_is_fastest_and_its_first_line_fits(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    engine.off_ms = 5.0  # the run without a cache beats every cache (as on the CPU device)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(80, 40)) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, TuneWizard) and app.screen.report is not None)
        wizard = app.screen
        assert isinstance(wizard, TuneWizard)
        # The introduction wraps at the screen's edge: its last words are on the screen.
        intro = wizard.query_one("#intro", Static)
        assert "predicts every other size and share." in on_screen(intro), on_screen(intro)
        await until(pilot, lambda: "no expert cache" in str(wizard.query_one("#advice", Static).content))
        advice = str(wizard.query_one("#advice", Static).content)
        assert advice.startswith("recommended: no expert cache: it is the fastest here (200.0 t/s measured"), advice
        runs = wizard.query_one("#runs", DataTable)
        assert [str(c) for c in runs.get_row_at(runs.row_count - 1)] == ["off", "-", "200.0", "-"]
        # The confirm run measures the advice (no cache) against the setting in use.
        await until(pilot, lambda: wizard.verdict is not None)
        assert engine.confirms == [((1.0, 0.0), (0.0, 0.0))]


@pytest.mark.slow
async def test_wizard_cancel_changes_nothing(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS, sweep_delay=0.05)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await pilot.press("ctrl+t")
        await until(pilot, lambda: isinstance(app.screen, TuneWizard))
        await pilot.pause(0.1)
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen)
        await until(pilot, lambda: not app.engine_lock.locked())  # the sweep thread saw the stop
        assert engine.set_cache_calls == [] and engine.cache() == (1.0, 0.0)
        assert not app.config_path.exists()
        await say(pilot, screen, "still here")
