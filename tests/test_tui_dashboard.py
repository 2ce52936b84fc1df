"""The cache dashboard: its rate, its last snapshot, the MIN bound, the heat map, the charts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from moechat.app.reply_stream import FULL_EVERY
from moechat.app.settings import Settings
from moechat.widgets.dashboard import Dashboard
from moechat.widgets.expert_heatmap import CACHED, ExpertHeatmap, axis, heat_rows, legend
from moechat.widgets.layer_stats import LayerStats
from moechat.widgets.rows import RowsView, plain
from moechat.widgets.throughput import ThroughputPlot, thin
from testkit.fake_engine import FakeEngine, K
from testkit.pilot import WORDS, make_app, on_screen, ready, say, until
from textual.widgets import Static


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
    from moechat.app.cadence import Cadence

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
        # The CPU device copies a miss's expert within RAM: no upload over a link to name.
        assert totals.lines[2].startswith(f"copied {final.total.uploaded_bytes / 2**20:.1f} MiB  |")
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


def test_with_look_ahead_each_layer_shows_its_misses_the_exposed_ones_and_the_recall() -> None:
    """Per layer: the misses before prefetch (exposed + hidden by a prefetch), the exposed ones and the prediction's
    recall; without predictions the rows stay as they were. Every row fits the panel (43 columns)."""
    from dataclasses import replace

    from moechat.widgets.layer_stats import HEADER_AHEAD, layer_rows

    snap = FakeEngine(["x"]).snapshot()
    assert snap is not None
    assert "rec" not in plain(layer_rows(snap)[0])  # no predictions: the plain rows
    layers = tuple(replace(ls, small=replace(ls.small, predicted=10 + i, predicted_used=5 + i, prefetch_hits=i))
                   for i, ls in enumerate(snap.layers))  # fmt: skip
    rows = layer_rows(replace(snap, layers=layers))
    assert plain(rows[0]) == HEADER_AHEAD
    for row, ls in zip(rows[1:], layers, strict=True):
        t = ls.total
        cells = plain(row).split()
        assert cells[0] == str(ls.layer) and len(plain(row)) <= 43
        assert cells[-4:] == [str(t.misses + t.prefetch_hits), str(t.misses), f"{100 * t.recall:.0f}%",
                              str(ls.occupancy)]  # fmt: skip


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


async def test_a_model_on_the_ram_tier_shows_its_reads_on_the_dashboard(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS, ram_tier=True, cache_note="auto: off (the CPU device holds every expert already)")
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(140, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        totals = screen.query_one("#totals", RowsView)
        await until(pilot, lambda: any(line.startswith("RAM ") for line in totals.lines))
        snap = engine.snapshot()
        ram = snap.ram if snap is not None else None
        assert ram is not None
        row = next(line for line in totals.lines if line.startswith("RAM "))
        assert f"{100 * ram.hit_rate:.1f}%" in row and f"read {ram.bytes_read / 2**20:.0f} MiB" in row
