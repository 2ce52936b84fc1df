"""The Textual app with a scripted engine (and once with the real one): Pilot, polling, no sleeps."""

from __future__ import annotations

import asyncio
import csv
import gc
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from moechat.app.reply_stream import FULL_EVERY
from moechat.app.screens.chat import SHOWN_TURNS, ChatScreen
from moechat.app.screens.wizard import TuneWizard
from moechat.app.settings import Settings, resolve
from moechat.app.tui import MoechatApp
from moechat.app.tuned import read_tuned, tuned_path
from moechat.engine.events import Event
from moechat.widgets.chat_log import ChatInput, EarlierMarker, ReplyMarkdown, StreamedParagraph, Turn
from moechat.widgets.dashboard import Dashboard
from moechat.widgets.expert_heatmap import CACHED, ExpertHeatmap, axis, heat_rows, legend
from moechat.widgets.layer_stats import LayerStats
from moechat.widgets.rows import RowsView, plain
from moechat.widgets.throughput import ThroughputPlot, thin
from testkit.fake_engine import FakeEngine, K
from testkit.ggufgen import tiny_moe
from testkit.pilot import make_app, ready, say, until
from textual.binding import Binding
from textual.widgets import DataTable, Markdown, Static

WORDS = ["The", " river", " rose", " in", " spring", "."]


def on_screen(widget: Static) -> str:
    """The lines the widget draws in its region (what is cut off is not there)."""
    return " ".join(widget.render_line(y).text.strip() for y in range(widget.size.height))


def drawn(widget: Static) -> str:
    """The text a Static draws (its content is what it was given, before any markup is read)."""
    return str(widget.visual)


def reply_markdown(screen: ChatScreen) -> str:
    return screen.query(Turn).last().query_one(Markdown).source


async def test_send_streams_a_reply_and_saves_the_conversation(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        assert screen.conv.messages[0] == {"role": "user", "content": "hi"}
        assert screen.conv.messages[1]["content"] == "The river rose in spring."
        await until(pilot, lambda: "The river rose" in reply_markdown(screen))
        status = str(screen.query_one("#status", Static).content)
        assert "reply 6 tok" in status and "first token" in status and "context" in status
        # ... and all of it is on the screen: it wraps beside the dashboard instead of being cut.
        await until(pilot, lambda: "context" in on_screen(screen.query_one("#status", Static)))
        assert "eos" in on_screen(screen.query_one("#status", Static))
        saved = json.loads(app.store.path(screen.conv.id).read_text())
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
        # Up recalls the earlier prompt.
        await pilot.press("up")
        assert screen.query_one("#input").text == "hi"
        assert gc.get_freeze_count() > 0  # the app's long-lived heap is out of the collector's way
    assert gc.get_freeze_count() == 0  # ... until the app ends


def test_markdown_still_builds_paragraphs_from_the_private_class_the_chat_subclasses() -> None:
    """The chat's StreamedParagraph extends Textual's unexported MarkdownParagraph and swaps it into
    Markdown.BLOCKS: if Textual renames or stops using it, this fails here, not on a user's screen."""
    from moechat.widgets.chat_log import MarkdownParagraph

    assert Markdown.BLOCKS["paragraph_open"] is MarkdownParagraph
    assert issubclass(StreamedParagraph, MarkdownParagraph)


@pytest.mark.slow
async def test_a_streamed_reply_relays_out_only_as_it_grows_and_is_drawn_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from textual.app import App, ComposeResult

    layouts: list[bool] = []  # the layout flag of each update of the reply's paragraph on the screen
    update = Static.update

    def spy(self: Static, content: Any = "", *, layout: bool = True) -> None:
        if isinstance(self, StreamedParagraph) and self.is_mounted:
            layouts.append(layout)
        update(self, content, layout=layout)

    monkeypatch.setattr(Static, "update", spy)

    class OneReply(App[int]):  # nothing else on the screen relays it out
        def compose(self) -> ComposeResult:
            yield ReplyMarkdown()

    app = OneReply()
    async with app.run_test(size=(40, 20)) as pilot:
        md = app.query_one(ReplyMarkdown)
        stream = Markdown.get_stream(md)
        words: list[str] = []

        def words_on_screen() -> list[str]:
            return [w for p in md.query(StreamedParagraph) for w in on_screen(p).split()]

        for i in range(60):  # one word an append: wraps onto a new line every few
            words.append(f"w{i}")
            await stream.write(f" w{i}")
            await until(pilot, lambda: words_on_screen() == words)  # each word there: it grew when it had to
        await stream.stop()
        assert md.query_one(StreamedParagraph).size.height >= 6
        assert layouts.count(False) > layouts.count(True) > 1  # ... and kept its layout when it did not


@pytest.mark.slow
async def test_escape_stops_within_a_token_and_the_next_request_works(tmp_path: Path) -> None:
    engine = FakeEngine([f" w{i}" for i in range(400)], delay=0.01)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await pilot.press("h", "enter")
        await until(pilot, lambda: engine.tokens >= 5)
        box = screen.query_one(ChatInput)
        # While a reply streams the input's cursor stays lit instead of blinking (a blink is a frame).
        assert box.cursor_blink is False and box._cursor_visible and box.has_focus
        await pilot.press("escape")
        await until(pilot, lambda: not screen.generating)
        assert box.cursor_blink is True  # ... and blinks again once the reply ends
        last = screen.conv.messages[-1]
        assert last["stopped"] is True and 0 < len(last["content"].split()) < 400
        assert engine.tokens < 400
        assert "[stopped]" in drawn(screen.query(Turn).last().query_one(".role", Static))
        engine.words, engine.delay = WORDS, 0.0
        await say(pilot, screen, "again")
        assert screen.conv.messages[-1]["content"] == "The river rose in spring."


async def test_a_cache_auto_left_off_says_why_on_the_info_line_and_the_dashboard(tmp_path: Path) -> None:
    note = "auto: off (the CPU device holds every expert already)"
    app = make_app(tmp_path, FakeEngine(WORDS, cache_note=note))
    async with app.run_test(size=(140, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        totals = screen.query_one("#totals", RowsView)
        await until(pilot, lambda: "holds every expert" in " ".join(totals.lines))
        assert totals.lines[0].startswith("no expert cache") and totals.lines[1] == note
        assert note in on_screen(screen.query_one("#info", Static))


async def test_regenerate_replaces_the_last_reply(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        engine.words = ["Another", " reply"]
        await pilot.press("ctrl+r")
        await until(pilot, lambda: engine.replies == 2 and not screen.generating)
        assert [m["role"] for m in screen.conv.messages] == ["user", "assistant"]
        assert screen.conv.messages[-1]["content"] == "Another reply"
        assert len(screen.query(Turn)) == 2


@pytest.mark.slow
async def test_dashboard_updates_at_a_bounded_rate(tmp_path: Path) -> None:
    engine = FakeEngine([f" t{i}" for i in range(600)], delay=0.002)  # ~500 tokens/s
    app = make_app(tmp_path, engine, Settings(refresh_ms=250, n_predict=600))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        t0 = time.monotonic()
        await say(pilot, screen, "go")
        elapsed = time.monotonic() - t0
        dash = screen.query_one(Dashboard)
        assert dash.updates >= 2
        assert dash.updates <= elapsed / 0.25 + 3, (dash.updates, elapsed)
        # The costly views redraw with the publisher's full updates only: about once a second.
        plot = screen.query_one(ThroughputPlot)
        assert 1 <= plot.draws <= elapsed / FULL_EVERY + 2, (plot.draws, elapsed)
        layers = screen.query_one(LayerStats)
        assert layers.snapshot is not None and layers.snapshot.total.hits > 0


async def test_after_a_reply_the_dashboard_and_export_show_the_min_bound(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        totals = screen.query_one("#totals", RowsView)
        await say(pilot, screen, "hi")
        await until(pilot, lambda: app.session.min_hit_rate is not None)
        assert engine.min_calls == 1  # once per reply, after it
        await until(pilot, lambda: totals.lines[0].startswith("hit rate 75.0% (MIN 90.0%)  |  "))
        d = app.session.to_dict()
        assert d["min_hit_rate"] == 0.9 and d["replies"][-1]["min_hit_rate"] == 0.9
        from moechat.app.export import to_markdown

        assert "MIN (offline optimum, with bypass) at this size, on the same lookups" in to_markdown(d)
        assert "hit rate 90.0%" in to_markdown(d)
        # The next reply: while it streams no bound is shown (the last one covered other lookups).
        engine.pause = True
        await pilot.press("h", "enter")
        await until(pilot, lambda: screen.generating)
        await until(pilot, lambda: "MIN" not in totals.lines[0])
        engine.pause = False
        await until(pilot, lambda: not screen.generating and "(MIN 90.0%)" in totals.lines[0])


async def test_a_long_sessions_min_bound_is_shown_with_the_window_it_covers(tmp_path: Path) -> None:
    """Past the window the bound covers recent lookups only: shown beside the cache's own rate on them,
    not beside the session's hit rate, on screen and in the export."""
    engine = FakeEngine(WORDS)
    engine.window_after = 0
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        totals = screen.query_one("#totals", RowsView)
        await say(pilot, screen, "hi")
        await until(pilot, lambda: app.session.min_bound is not None)
        n = app.session.min_bound.tokens
        await until(pilot, lambda: any(line.startswith(f"last {n} tok 75.0% (MIN 90.0%)") for line in totals.lines))
        assert "MIN" not in totals.lines[0]
        from moechat.app.export import to_markdown

        d = app.session.to_dict()
        assert d["min_bound"] == {"rate": 0.9, "hit_rate": 0.75, "tokens": n, "from_start": False}
        assert f"its last {n} tokens (from the slots as they were then): hit rate 90.0%, against 75.0%" in to_markdown(
            d
        )


def test_the_cadence_sends_at_most_once_a_period_and_always_the_last() -> None:
    from moechat.engine.cache.stats import Cadence

    now = [0]
    cadence = Cadence(20, 100, clock=lambda: now[0])  # in milliseconds: exact steps
    sent = []
    for step in range(300):  # 0.3 s of asking every millisecond
        now[0] = step
        send, full = cadence.due()
        assert send or not full  # a full update is a sent one
        if send:
            sent.append((step, full))
    assert [s for s, _ in sent] == list(range(0, 300, 20))  # once every 20 ms, from the first ask
    assert [s for s, full in sent if full] == list(range(0, 300, 100))  # a full one every 100 ms
    now[0] = 281  # just after a send
    assert cadence.due() == (False, False)
    assert cadence.due(last=True) == (True, True)  # the last one still goes, full


async def test_dashboard_draws_the_final_snapshot(tmp_path: Path) -> None:
    # The heat map redraws at most once a second; the end of a reply must still show its last state.
    engine = FakeEngine([f" w{i}" for i in range(40)], delay=0.001)
    app = make_app(tmp_path, engine, Settings(refresh_ms=250, n_predict=40))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "go")
        final = engine.snapshot()
        assert final is not None
        heat = screen.query_one(ExpertHeatmap)
        assert heat.lines == [plain(row) for row in heat_rows(final)]
        # What the screen draws: the rows' text, one line each, the widget as tall as its rows.
        assert [heat.render_line(y).text.rstrip() for y in range(heat.size.height)] == [
            line.rstrip() for line in heat.lines
        ]
        totals = screen.query_one("#totals", RowsView)
        assert totals.size.height == len(totals.lines) == 5
        assert totals.lines[0].startswith(f"hit rate {100 * final.total.hit_rate:.1f}%")
        # The fake engine's hits after t tokens: t * K * 3 // 4 in every layer; the window is a difference of two.
        span = int(totals.lines[1].split()[1])
        t1, t0 = final.tokens, final.tokens - span
        rate = (t1 * K * 3 // 4 - t0 * K * 3 // 4) / ((t1 - t0) * K)
        assert span >= 32 and totals.lines[1].startswith(f"last {span} tok {100 * rate:.1f}%  |  worst 0 ")
        assert totals.lines[3].startswith(f"cpu misses {final.total.cpu}  |")
        assert all(len(line) <= totals.size.width for line in totals.lines)  # nothing cropped
        stats = screen.query_one(LayerStats)
        layers = stats.lines
        assert [stats.render_line(y).text.rstrip() for y in range(stats.size.height)] == [
            line.rstrip() for line in layers
        ]
        assert len(layers) == len(final.layers) + 1
        for line, ls in zip(layers[1:], final.layers, strict=True):
            assert line.split()[0] == str(ls.layer)
            assert line.split()[-3:] == [f"{100 * ls.total.hit_rate:.0f}", str(ls.total.cpu), str(ls.occupancy)]
        # One tokens/s: the chart's last point is the figure the status line and the export show.
        rate = app.session.replies[-1]["gen_tps"]
        assert rate > 0 and screen.query_one(ThroughputPlot).points[-1][1] == rate
        assert f"{rate:.1f} t/s" in str(screen.query_one("#status", Static).content)


@pytest.mark.parametrize("n_layers", [30, 18])  # the demos: SmolLM2's and Gemma's MoE layers
@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
async def test_the_dashboard_fits_the_demos_layers_without_scrolling(
    tmp_path: Path, size: tuple[int, int], n_layers: int
) -> None:
    """A demo's MoE layers of 16 experts: runs of layers share a row so that the per-layer rows and
    the heat map end inside the panel; every layer is still counted."""
    engine = FakeEngine([f" w{i}" for i in range(30)], n_layers=n_layers, n_expert=16)
    app = make_app(tmp_path, engine, Settings(n_predict=30))
    last = str(n_layers - 1)
    async with app.run_test(size=size) as pilot:
        screen = await ready(pilot)
        dash = screen.query_one(Dashboard)
        if not dash.display:
            await pilot.press("ctrl+b")
        await say(pilot, screen, "go")
        heat, stats = screen.query_one(ExpertHeatmap), screen.query_one(LayerStats)
        await until(
            pilot, lambda: heat.lines[-1].split()[:1] != [] and heat.lines[-1].split()[0].split("-")[-1] == last
        )
        assert dash.max_scroll_y == 0, (dash.max_scroll_y, dash.size)
        assert heat.region.bottom <= dash.region.bottom
        labels = [line.split()[0] for line in heat.lines]
        assert labels[-1].endswith(last) and len(labels) < n_layers  # folded, the last layer included
        covered = [int(x) for label in labels for x in label.split("-")]
        assert covered[0] == 0 and max(covered) == n_layers - 1
        assert sum(int(line.split()[-1]) for line in stats.lines[1:]) == 3 * n_layers  # slots: every layer's, summed


def test_heat_rows_mark_exactly_the_cached_experts() -> None:
    snap = FakeEngine(["x"]).snapshot()
    assert snap is not None
    for row, ls in zip(heat_rows(snap), snap.layers, strict=True):
        marked, at = set(), 0
        for text, style in row:
            if style == CACHED:
                marked |= set(range(at, at + len(text)))
            at += len(text)
        offset = len(f"{ls.layer:>3} ")
        assert marked == {offset + e for e in ls.cached}
        assert len(plain(row)) == offset + len(ls.use_counts)


def test_the_heat_maps_axis_numbers_the_experts_over_their_columns() -> None:
    snap = FakeEngine(["x"], n_expert=40).snapshot()
    assert snap is not None
    line, row = axis(snap), plain(heat_rows(snap)[0])
    assert line.startswith("  L ") and len(line) <= len(row)
    offset = line.index("0")
    assert offset == len(f"{snap.layers[0].layer:>3} ")  # expert 0 over the first column
    assert line[offset + 16 : offset + 18] == "16" and line[offset + 32 : offset + 34] == "32"
    wide = FakeEngine(["x"], n_expert=256).snapshot()  # folded to 64 columns: four experts a column
    assert wide is not None and axis(wide)[4 + 16 : 4 + 18] == "64"


def test_the_heat_map_has_a_legend_of_its_characters_and_its_cached_mark() -> None:
    """Every character the map draws is in the legend, and the legend's cached mark has the map's style."""
    text = legend()
    snap = FakeEngine(["x"]).snapshot()
    assert snap is not None
    drawn = {c for row in heat_rows(snap) for part, _ in row[1:] for c in part}
    assert drawn <= set(text.plain) and "cached" in text.plain and "unused" in text.plain
    assert any(str(span.style) == CACHED for span in text.spans)


def test_throughput_chart_thins_long_series_keeping_their_shape() -> None:
    points = [(i, 10.0 + (i // 100)) for i in range(300)]  # three plateaus: 10, 11, 12 t/s
    xs, ys = thin(points, 40)
    assert len(xs) == len(ys) == 40
    assert xs == sorted(xs) and xs[0] < 10 and xs[-1] > 290
    assert ys[0] == 10.0 and ys[-1] == 12.0 and set(ys) >= {10.0, 11.0, 12.0}
    assert abs(sum(ys) / len(ys) - 11.0) < 0.05
    assert thin(points[:5], 40) == ([0.0, 1.0, 2.0, 3.0, 4.0], [10.0] * 5)  # short series: unchanged


@pytest.mark.slow
async def test_engine_failure_is_shown_and_the_app_stays_usable(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS, fail_after=3)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        assert "injected engine failure" in str(screen.query_one("#status", Static).content)
        saved = json.loads(app.store.path(screen.conv.id).read_text())
        assert saved["messages"][1]["content"] == "The river rose"  # the part written before the failure
        engine.fail_after = None
        await say(pilot, screen, "again")
        assert screen.conv.messages[-1]["content"] == "The river rose in spring."


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["missing", "fake", "truncated"])
async def test_a_model_that_does_not_load_stays_on_screen_and_the_app_exits_non_zero(tmp_path: Path, kind: str) -> None:
    """The real engine process on a bad file: its one-line error replaces the spinner until a key is pressed."""
    from moechat.app.paths import AppPaths
    from moechat.app.tui import LoadFailed, real_engine_factory
    from textual.widgets import Label

    model = tmp_path / "model.gguf"
    if kind == "fake":
        model.write_bytes(b"not a model at all, just some bytes" * 10)
    elif kind == "truncated":
        whole = tiny_moe(tmp_path / "whole.gguf").read_bytes()
        model.write_bytes(whole[: len(whole) // 2])
    settings = Settings()
    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    app = MoechatApp(real_engine_factory(str(model), settings, None), settings, paths=paths)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.failure is not None, timeout=120)
        await until(pilot, lambda: isinstance(app.screen, LoadFailed) and bool(app.screen.query("#what")))
        shown = str(app.screen.query_one("#what", Label).render())
        assert shown.startswith("moechat: error:") and "model.gguf" in shown, shown
        assert "\n" not in shown
        await pilot.press("q")
        await until(pilot, lambda: app.return_code is not None)
    assert app.return_code == 2


def _loading_app(tmp_path: Path, engine: FakeEngine, fail: str = "") -> tuple[MoechatApp, Any, list[str]]:
    """An app whose engine loads only when the test says so (`go.set()`), reporting progress meanwhile."""
    import threading

    from moechat.app.paths import AppPaths

    go = threading.Event()
    said: list[str] = []

    def factory(progress: Any) -> FakeEngine:
        progress("compiling kernels for this model (first start only) [....................] 1 of about 200")
        said.append("progress")
        go.wait(30)
        if fail:
            raise ValueError(fail)
        return engine

    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    return MoechatApp(factory, Settings(), paths=paths), go, said


async def test_the_input_works_while_the_model_loads_and_a_queued_message_gets_its_reply(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app, go, said = _loading_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and isinstance(app.focused, ChatInput))
        screen = app.screen
        assert isinstance(screen, ChatScreen) and app.engine is None
        info = screen.query_one("#info", Static)
        await until(pilot, lambda: "1 of about 200" in drawn(info))  # the load's progress, on the chat screen
        for ch in "hi":
            await pilot.press(ch)
        await pilot.press("enter")
        await until(pilot, lambda: len(screen.conv.messages) == 1)
        assert screen.conv.messages[0]["content"] == "hi" and len(screen.query(Turn)) == 1
        status = screen.query_one("#status", Static)
        assert "queued" in drawn(status) and not screen.generating
        # A second message, the wizard and the export wait for the engine too: refused, nothing changes.
        await pilot.press("x", "enter")
        await pilot.press("ctrl+t")
        await pilot.press("ctrl+e")
        await until(pilot, lambda: len(app._notifications) >= 3)
        notes = " | ".join(n.message for n in app._notifications)
        assert "already waits" in notes and "wizard runs once the model is loaded" in notes, notes
        assert app.screen is screen and len(screen.conv.messages) == 1
        assert not (tmp_path / "data" / "exports").exists()
        go.set()
        await until(pilot, lambda: len(screen.conv.messages) == 2 and not screen.generating)
        assert screen.conv.messages[1]["content"] == "The river rose in spring."
        assert screen.conv.model == engine.info.name and engine.info.name in drawn(info)
        assert "reply 6 tok" in drawn(status)
        assert said == ["progress"]


async def test_a_load_that_fails_keeps_the_message_sent_meanwhile(tmp_path: Path) -> None:
    from moechat.app.tui import LoadFailed

    app, go, _ = _loading_app(tmp_path, FakeEngine(WORDS), fail="m.gguf: unsupported architecture 'mamba'")
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.focused, ChatInput))
        screen = app.screen
        assert isinstance(screen, ChatScreen)
        for ch in "keep me":
            await pilot.press(ch if ch != " " else "space")
        await pilot.press("enter")
        await until(pilot, lambda: len(screen.conv.messages) == 1)
        go.set()
        await until(pilot, lambda: isinstance(app.screen, LoadFailed) and bool(app.screen.query("#what")))
        assert "unsupported architecture" in str(app.screen.query_one("#what").render())
        saved = json.loads(app.store.path(screen.conv.id).read_text())
        assert saved["messages"] == [{"role": "user", "content": "keep me"}]
        await pilot.press("q")
        await until(pilot, lambda: app.return_code is not None)
    assert app.return_code == 2


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


async def test_export_files_parse_and_match_the_counters(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        await pilot.press("ctrl+e")  # the key works from the input box
        await until(pilot, lambda: (tmp_path / "data" / "exports").is_dir())
        assert len(list((tmp_path / "data" / "exports").glob("stats-*"))) == 3
        written = app.export_all(tmp_path / "out")
        snap = engine.snapshot()
        assert snap is not None
        by_ext = {p.suffix: p for p in written if p.name.startswith("stats")}
        d = json.loads(by_ext[".json"].read_text())
        assert d["schema_version"] == 1 and d["model"]["name"] == "fake.gguf" and d["started"].endswith("+00:00")
        assert [row["hits"] for row in d["layers"]] == [ls.total.hits for ls in snap.layers]
        assert d["replies"][0]["n_generated"] == 6
        rows = list(csv.DictReader(io.StringIO(by_ext[".csv"].read_text())))
        assert len(rows) == len(snap.layers) and int(rows[0]["lookups"]) == snap.layers[0].total.lookups
        md = by_ext[".md"].read_text()
        assert "| model |" in md and "| tg6 |" in md and "\x1b" not in md
        # The recent window: the fake engine hits 3 of 4 lookups, whatever the span.
        recent = [p for p in d["series"] if p["recent_tokens"]]
        assert d["recent_window_min_tokens"] == 32 and recent
        assert all(abs(p["recent_hit_rate"] - 0.75) <= 1 / (K * p["recent_tokens"]) for p in recent)
        rate, span = recent[-1]["recent_hit_rate"], recent[-1]["recent_tokens"]
        assert f"Recent hit rate: {100 * rate:.1f}% over the last {span} tokens." in md
        chat = next(p for p in written if p.name.startswith("chat"))
        assert "The river rose in spring." in chat.read_text()


async def test_export_records_the_settings_each_reply_ran_with(tmp_path: Path) -> None:
    from dataclasses import replace

    app = make_app(tmp_path, FakeEngine(WORDS))
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        first = app.settings.temp
        app.settings = replace(app.settings, temp=0.3, system="Answer in one line.")  # as the settings dialog does
        await say(pilot, screen, "again")
        written = app.export_all(tmp_path / "out")
    d = json.loads(next(p for p in written if p.name.startswith("stats") and p.suffix == ".json").read_text())
    assert d["settings"]["temp"] == 0.3 and d["settings"]["system"] == "Answer in one line."
    assert [r["settings"]["temp"] for r in d["replies"]] == [first, 0.3] and first != 0.3
    assert d["replies"][1]["settings"]["system"] == "Answer in one line."
    md = next(p for p in written if p.name.startswith("stats") and p.suffix == ".md").read_text()
    assert "| 2 | " in md and "Answer in one line." in md


async def test_export_to_a_read_only_folder_keeps_the_old_file(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    out = tmp_path / "ro"
    out.mkdir()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        out.chmod(0o500)
        try:
            if (out / "probe").parent.stat().st_mode & 0o200 == 0 and not _writable(out):
                assert app.export_all(out) == []
                assert list(out.iterdir()) == []
        finally:
            out.chmod(0o700)


def _writable(folder: Path) -> bool:
    try:
        (folder / ".probe").write_text("x")
    except OSError:
        return False
    (folder / ".probe").unlink()
    return True


async def test_runs_at_80x24(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        await pilot.press("ctrl+b")
        assert not screen.query_one(Dashboard).display
        await pilot.press("ctrl+b")
        assert screen.query_one(Dashboard).display


def shown(screen: ChatScreen) -> list[str]:
    """The text of each turn in the log, as its Markdown holds it (streamed replies included)."""
    return [t.query_one(Markdown).source.strip() for t in screen.query(Turn)]


@pytest.mark.slow
async def test_long_chats_keep_the_recent_turns_and_bring_earlier_ones_back(tmp_path: Path) -> None:
    # Each text update relays out every widget in the log: a long chat keeps only its recent turns.
    engine = FakeEngine(["ok"])
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        for i in range(8):
            await say(pilot, screen, f"q{i}")
        n = len(screen.conv.messages)
        assert n == 16 and screen.first_shown == n - SHOWN_TURNS
        assert shown(screen) == [m["content"] for m in screen.conv.messages[n - SHOWN_TURNS :]]
        marker = screen.query_one(EarlierMarker)
        assert marker.display and f"{n - SHOWN_TURNS} earlier messages" in str(marker.content)

        # Scrolling to the top brings the earlier turns back, and the view stays on the turn it showed.
        log = screen.query_one("#log")
        assert log.max_scroll_y > 0
        oldest = screen.query(Turn).first()
        log.scroll_home(animate=False)
        await until(pilot, lambda: screen.first_shown == 0)
        assert shown(screen) == [m["content"] for m in screen.conv.messages]
        assert not marker.display
        await until(pilot, lambda: log.scroll_y == oldest.virtual_region.y > 0)

        # The next exchange trims again; the reply still streams in and is saved in full.
        await say(pilot, screen, "again")
        assert len(screen.query(Turn)) == SHOWN_TURNS and screen.first_shown == 18 - SHOWN_TURNS
        assert screen.conv.messages[-1]["content"] == "ok" and len(screen.conv.messages) == 18


@pytest.mark.slow
async def test_reopened_long_chat_mounts_its_last_turns_and_a_click_shows_more(tmp_path: Path) -> None:
    engine = FakeEngine(["ok"])
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 80)) as pilot:  # tall: every turn shown fits, the marker too
        screen = await ready(pilot)
        conv = screen.conv
        conv.messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(30)]
        await screen.load_conversation(conv)
        assert screen.first_shown == 30 - SHOWN_TURNS and shown(screen) == [f"m{i}" for i in range(18, 30)]
        await pilot.pause()  # laid out: the marker has its place on the screen
        await pilot.click(EarlierMarker)
        await until(pilot, lambda: screen.first_shown == 8)
        assert shown(screen) == [f"m{i}" for i in range(8, 30)]
        screen.query_one("#log").scroll_home(animate=False)  # the view stayed put: the rest is above
        await until(pilot, lambda: screen.first_shown == 0)
        assert shown(screen) == [f"m{i}" for i in range(30)]
        await pilot.press("ctrl+n")
        await until(pilot, lambda: not screen.query(Turn))
        assert screen.first_shown == 0 and not screen.query_one(EarlierMarker).display


@pytest.mark.slow
async def test_command_palette_has_every_chat_action(tmp_path: Path) -> None:
    engine = FakeEngine(["ok"])
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        titles = {c.title for c in app.get_system_commands(screen)}
        for binding in ChatScreen.BINDINGS:
            assert isinstance(binding, Binding)
            action = getattr(screen, f"action_{binding.action}")
            assert any(c.callback == action for c in app.get_system_commands(screen)), binding.action
        assert "Earlier messages" in titles
        # Run one through the palette: a reopened long chat shows its earlier turns.
        conv = screen.conv
        conv.messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(20)]
        await screen.load_conversation(conv)
        await pilot.pause()
        assert screen.first_shown == 20 - SHOWN_TURNS  # laid out at the bottom: nothing came back by itself
        await pilot.press("ctrl+p")
        for ch in "Earlier":
            await pilot.press(ch)
        await pilot.press("enter")
        await until(pilot, lambda: screen.first_shown == 0)
        assert shown(screen) == [f"m{i}" for i in range(20)]


@pytest.mark.slow
def test_the_shipped_app_chats_through_its_engine_process(tmp_path: Path) -> None:
    """The app as `moechat` runs it: real_engine_factory starts the engine process (a real model,
    its expert cache); the chat screen streams a reply from it and shows the cache's counters."""
    from moechat.app.paths import AppPaths
    from moechat.app.tui import real_engine_factory
    from moechat.engine.loader import load_model
    from testkit.ggufgen import tiny_moe

    path = tiny_moe(tmp_path / "m.gguf", n_expert=8, n_expert_used=2)
    load_model(path, n_ctx=256).close()  # its kernels compile here, into numba's disk cache
    settings = Settings(n_predict=12, temp=0.0, ctx_size=256, device="cpu", moe_cache_mib=1.5, threads=1)
    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    app = MoechatApp(real_engine_factory(str(path), settings, tmp_path / "warm"), settings, paths=paths)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot, timeout=120)  # a fresh interpreter imports torch and loads the model
            await say(pilot, screen, "Hello")
            assert screen.conv.messages[-1]["role"] == "assistant" and screen.conv.messages[-1]["content"]
            snap = screen.query_one(LayerStats).snapshot
            assert snap is not None and snap.total.hits > 0 and app.engine.info.name == "m.gguf"

    asyncio.run(run())
    assert list((tmp_path / "warm").glob("*.json"))  # the engine process saved the use counts at exit


@pytest.mark.parametrize(
    ("low", "high"),
    [
        ("default", "config"),
        ("default", "env"),
        ("default", "flag"),
        ("config", "env"),
        ("config", "flag"),
        ("env", "flag"),
    ],
)
def test_settings_layers(tmp_path: Path, low: str, high: str) -> None:
    config = tmp_path / "config.toml"
    values = {"default": None, "config": 0.3, "env": 0.6, "flag": 0.9}
    if "config" in (low, high):
        config.write_text(f"moe_cache_cpu_share = {values['config']}\n")
    env = {"MOECHAT_MOE_CACHE_CPU_SHARE": str(values["env"])} if "env" in (low, high) else {}
    flags = {"moe_cache_cpu_share": values["flag"]} if "flag" in (low, high) else {}
    s, warnings = resolve(flags, env, config)
    assert not warnings
    assert s.moe_cache_cpu_share == values[high]
    assert s.source("moe_cache_cpu_share").startswith({"config": str(config), "env": "env", "flag": "flag"}[high])


def test_the_demo_has_its_own_defaults_below_anything_the_user_set(tmp_path: Path) -> None:
    from moechat.app.settings import DEMO_DEFAULTS, for_demo, mib_words

    config = tmp_path / "config.toml"
    config.write_text("moe_cache_mib = 8\n")
    s = for_demo(resolve({}, {"MOECHAT_MOE_CACHE_CPU_SHARE": "0.25"}, config)[0], None)
    assert (s.moe_cache_mib, s.source("moe_cache_mib")) == (8.0, str(config))
    assert (s.moe_cache_cpu_share, s.source("moe_cache_cpu_share")) == (0.25, "env MOECHAT_MOE_CACHE_CPU_SHARE")
    s = for_demo(resolve({}, {}, config)[0], None)
    assert s.moe_cache_cpu_share == DEMO_DEFAULTS["smollm2"]["moe_cache_cpu_share"] > 0
    assert s.source("moe_cache_cpu_share") == "the demo's default"
    # No setting at all: the demo runs with a cache, so the dashboard has something to show.
    d = for_demo(Settings(), None)
    assert d.moe_cache_mib == DEMO_DEFAULTS["smollm2"]["moe_cache_mib"] > 0 and d.cpu_kernels == "fast"
    # The second demo has its own size; the user's own model gets the plain defaults.
    assert for_demo(Settings(), "demo:gemma").moe_cache_mib == DEMO_DEFAULTS["gemma"]["moe_cache_mib"]
    assert DEMO_DEFAULTS["gemma"]["moe_cache_mib"] != DEMO_DEFAULTS["smollm2"]["moe_cache_mib"]
    # The user's own model gets the plain defaults: a cache sized by itself (auto).
    assert for_demo(Settings(), "m.gguf") == Settings() and mib_words(Settings().moe_cache_mib) == "auto"


def test_bad_settings_name_the_setting_and_source(tmp_path: Path) -> None:
    from moechat.app.settings import SettingError, save_config

    with pytest.raises(SettingError, match=r"moe_cache_mib from env MOECHAT_MOE_CACHE_MIB: -1.0 must be >= 0"):
        resolve({}, {"MOECHAT_MOE_CACHE_MIB": "-1"}, None)
    with pytest.raises(SettingError, match=r"moe_cache_cpu_share from flag --moe-cache-cpu-share"):
        resolve({"moe_cache_cpu_share": 1.5}, {}, None)
    config = tmp_path / "config.toml"
    config.write_text('device = "tpu"\n')
    with pytest.raises(SettingError, match=rf"device from {config}"):
        resolve({}, {}, config)
    # A corrupt file: a warning, the defaults, the file untouched; saving sets it aside.
    config.write_text("moe_cache_mib = = 3\n")
    s, warnings = resolve({}, {}, config)
    assert s == Settings() and warnings and "not valid TOML" in warnings[0]
    assert config.read_text() == "moe_cache_mib = = 3\n"
    save_config(config, {"theme": "nord"})
    aside = list(tmp_path.glob("config.toml.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == "moe_cache_mib = = 3\n"
    assert resolve({}, {}, config)[0].theme == "nord"


@pytest.mark.slow
async def test_conversations_reopen_and_theme_is_remembered(tmp_path: Path) -> None:
    from moechat.app.screens.dialogs import OpenChat

    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "first chat")
        first_id = screen.conv.id
        await pilot.press("ctrl+n")
        await until(pilot, lambda: not screen.conv.messages and not screen.query(Turn))
        await say(pilot, screen, "second")
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, OpenChat))
        titles = [c.title for c in app.screen.conversations]
        assert titles == ["second", "first chat"]
        await pilot.press("down", "enter")
        await until(pilot, lambda: app.screen is screen and screen.conv.id == first_id)
        await until(pilot, lambda: len(screen.query(Turn)) == 2)
        assert screen.conv.messages[0]["content"] == "first chat"
        app.theme = "nord"
        await until(pilot, lambda: app.config_path.is_file())
        assert resolve({}, {}, app.config_path)[0].theme == "nord"


def test_export_command_renders_a_saved_session(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from moechat.app.cli import main

    home = tmp_path / "home"
    monkeypatch.setenv("MOECHAT_HOME", str(home))
    assert main(["export"]) == 2
    assert "no saved sessions" in capsys.readouterr().err
    engine = FakeEngine(WORDS)
    from moechat.app.paths import app_paths

    app = MoechatApp(lambda progress: engine, Settings(), paths=app_paths())

    async def chat() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await say(pilot, await ready(pilot), "hi")

    asyncio.run(chat())
    assert main(["export", "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 4 and int(rows[0]["lookups"]) > 0
    out = tmp_path / "r.md"
    assert main(["export", "-f", "md", "-o", str(out)]) == 0
    assert "| layer |" in out.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["export", str(bad)]) == 2


@pytest.mark.slow
def test_process_engine_streams_stops_and_reports_errors(tmp_path: Path) -> None:
    import threading

    from moechat.app.engine_process import EngineSpec, ProcessEngine
    from moechat.engine.events import DoneEvent, SamplingParams, TokenEvent
    from testkit.ggufgen import tiny_moe

    path = tiny_moe(tmp_path / "m.gguf")
    progress: list[str] = []
    engine = ProcessEngine(
        EngineSpec(
            str(path), Settings(ctx_size=256, device="cpu", moe_cache_mib=1.0, moe_cache_cpu_share=0.5, threads=1)
        ),
        progress.append,
    )
    try:
        assert engine.info.name == "m.gguf" and any("loading" in p for p in progress)
        assert engine.info.hardware.endswith(", 1 threads")  # --threads reaches the engine process
        prompt, dropped, note = engine.fit_messages([{"role": "user", "content": "Hello"}])
        assert prompt and dropped == 0 and note == ""
        events = list(engine.reply(prompt, SamplingParams(temperature=0.0), 12, threading.Event()))
        assert isinstance(events[-1], DoneEvent) and events[-1].n_generated == 12
        snap = engine.snapshot()
        assert snap is not None and snap.total.lookups > 0 and snap.cpu_share == 0.5
        stop = threading.Event()
        n = 0
        for ev in engine.reply(prompt, SamplingParams(temperature=0.0), 200, stop):
            if isinstance(ev, TokenEvent):
                n += 1
                if n == 3:
                    stop.set()
            elif isinstance(ev, DoneEvent):
                assert ev.stop_reason == "stopped" and ev.n_generated <= 5
        engine.set_cache(2.0, 0.0)
        assert engine.cache() == (2.0, 0.0)
        with pytest.raises(ValueError, match="cpu-share"):
            engine.set_cache(1.0, 3.0)
        assert engine.cache() == (2.0, 0.0)  # a refused change keeps the cache it had
    finally:
        engine.close()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(10))
    with pytest.raises(ValueError, match="bad.gguf"):
        ProcessEngine(EngineSpec(str(bad), Settings(ctx_size=256, device="cpu")))


@pytest.mark.slow
async def test_a_failing_save_is_reported_and_the_old_file_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import moechat.app.atomic as atomic

    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    shown: list[str] = []
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "first")
        saved = app.store.path(screen.conv.id)
        before = saved.read_bytes()

        def full_disk(src: str, dst: str) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(atomic.os, "replace", full_disk)
        monkeypatch.setattr(app, "notify", lambda message, **kw: shown.append(str(message)))
        await say(pilot, screen, "second")
        assert any("could not save the conversation" in m and "No space" in m for m in shown)
        assert saved.read_bytes() == before
        assert app.export_all(tmp_path / "exports") == []
        assert any("export failed" in m for m in shown)
        assert [m["content"] for m in screen.conv.messages][-2:] == ["second", "The river rose in spring."]


MARKUP = "[/x] a [b]b[/b] [@click=app.quit]q[/] [/]"


@pytest.mark.slow
async def test_text_from_users_files_and_errors_is_shown_as_written_never_as_markup(tmp_path: Path) -> None:
    """Square brackets in a prompt, a system prompt or an error are text: Textual's markup would
    swallow them ("[stopped]"), run them ("[@click=...]") or fail on them ("[/x]": MarkupError)."""
    from moechat.app.screens.dialogs import OpenChat
    from textual.widgets import OptionList

    class FailsWithBrackets(FakeEngine):
        def reply(self, *args: Any, **kw: Any) -> Iterator[Event]:
            if self.replies >= 1:
                raise RuntimeError(f"bad state {MARKUP}")
            return super().reply(*args, **kw)

    engine = FailsWithBrackets(WORDS)
    app = make_app(tmp_path, engine, Settings(system=f"be brief {MARKUP}"))
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        screen = await ready(pilot)
        assert f"system: be brief {MARKUP}"[:40] in drawn(screen.query_one("#info", Static))
        await say(pilot, screen, MARKUP)
        await pilot.press("ctrl+n")
        await until(pilot, lambda: not screen.query(Turn))
        await pilot.press("ctrl+o")
        await until(pilot, lambda: isinstance(app.screen, OpenChat))
        option = app.screen.query_one(OptionList).get_option_at_index(0)
        assert str(option.prompt).endswith(MARKUP)
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is screen and len(screen.query(Turn)) == 2)
        assert drawn(screen.query_one("#status", Static)) == f"reopened: {MARKUP}"
        engine.replies = 1
        await say(pilot, screen, "again")
        assert drawn(screen.query_one("#status", Static)) == f"error: RuntimeError: bad state {MARKUP}"
        assert "[error]" in drawn(screen.query(Turn).last().query_one(".role", Static))
        # The notification ("the engine failed: ...") shows it as written too.
        await until(pilot, lambda: any(MARKUP in str(t.render()) for t in app.screen.query("Toast")))
        assert app.is_running


def test_the_session_export_adds_up_every_cache_the_session_ran(tmp_path: Path) -> None:
    # The wizard and a settings change rebuild the engine's cache, whose counters start again:
    # the session's export still counts everything since the session began.
    from moechat.app.export import SessionStats
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.cache.stats import StatsSnapshot
    from moechat.engine.events import GREEDY
    from moechat.engine.generate import generate
    from moechat.engine.loader import load_model

    lm = load_model(tiny_moe(tmp_path / "m.gguf"), n_ctx=128, cache=CacheSettings(mib=1.0, cpu_share=0.5))
    session = SessionStats({"name": "tiny"}, {"moe_cache_mib": 1.0, "moe_cache_cpu_share": 0.5})

    def reply() -> StatsSnapshot:
        prompt = lm.tokenizer.encode("The harbour town was quiet in winter")
        for _ in generate(
            lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=12, params=GREEDY, ignore_eos=True
        ):
            pass
        assert lm.cache is not None
        return lm.cache.snapshot()

    first = reply()
    session.add(first, 12, 10.0)
    session.cache_rebuilt()
    session.settings = {"moe_cache_mib": 1.0, "moe_cache_cpu_share": 0.0}
    lm.set_cache(CacheSettings(mib=1.0, prefetch=True))
    second = reply()
    session.add(second, 24, 10.0)
    lm.close()
    d = session.to_dict()
    # The prefetch counters (the second cache prefetched) add up too, and the report states them.
    p = d["prefetch"]
    assert p["prefetched"] == second.total.prefetched > 0 and p["prefetch_hits"] == second.total.prefetch_hits
    from moechat.app.export import to_markdown

    assert f"Prefetch: {p['prefetched']} experts uploaded ahead" in to_markdown(d)
    assert second.tokens < first.tokens + second.tokens == d["tokens"]
    for row, a, b in zip(d["layers"], first.layers, second.layers, strict=True):
        assert row["hits"] == a.total.hits + b.total.hits and row["lookups"] == a.total.lookups + b.total.lookups
        assert row["small"]["uploads"] == a.small.uploads + b.small.uploads
    assert d["cache_periods"] == [{
        "settings": {"moe_cache_mib": 1.0, "moe_cache_cpu_share": 0.5}, "tokens": first.tokens,
        "hits": first.total.hits, "lookups": first.total.lookups, "cpu": first.total.cpu,
        "uploads": first.total.uploads,
    }]  # fmt: skip


async def test_the_export_shows_the_cache_in_use_after_a_cache_change(tmp_path: Path) -> None:
    """After the wizard's Apply no reply has streamed the new cache's counters: the export still gives the
    live slots held and CPU share (what the dashboard shows), not a blank cache."""
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        engine.set_cache(1.5, 0.9)
        app.apply_cache_settings(1.5, 0.9)  # as the wizard's Apply does: the session's cache starts again
        (json_file,) = [p for p in app.export_all(tmp_path / "out") if p.suffix == ".json"]
    d = json.loads(json_file.read_text())
    live = engine.snapshot()
    assert live is not None
    assert d["cpu_share"] == 0.9 == live.cpu_share
    assert [layer["occupancy"] for layer in d["layers"]] == [ls.occupancy for ls in live.layers]
    assert all(layer["occupancy"] > 0 for layer in d["layers"])


async def test_the_dashboard_says_what_its_totals_cover(tmp_path: Path) -> None:
    """The totals count the cache in use: the whole session until a cache change, then since the change
    (the export's headline adds every cache up, and says so)."""
    from moechat.widgets.dashboard import SCOPES

    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        title = screen.query_one("#cache-title", Static)
        await say(pilot, screen, "hi")
        await until(pilot, lambda: not screen.generating)
        assert str(title.content) == SCOPES[False] == "expert cache (this session)"
        engine.set_cache(1.5, 0.9)
        app.apply_cache_settings(1.5, 0.9)  # as the wizard's Apply does
        await say(pilot, screen, "again")
        await until(pilot, lambda: str(title.content) == "expert cache (since the last change)")
