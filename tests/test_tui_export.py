"""Session exports from the app and from `moechat export`: files that parse and add up."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from pathlib import Path
from xml.etree import ElementTree

import pytest
from moechat.app.settings import Settings
from moechat.app.tui import MoechatApp
from testkit.fake_engine import FakeEngine, K
from testkit.ggufgen import tiny_moe
from testkit.pilot import WORDS, make_app, ready, say, until


async def test_export_files_parse_and_match_the_counters(tmp_path: Path) -> None:
    engine = FakeEngine(WORDS)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await ready(pilot)
        await say(pilot, screen, "hi")
        await pilot.press("ctrl+e")  # the key works from the input box
        await until(pilot, lambda: (tmp_path / "data" / "exports").is_dir())
        names = sorted(p.suffix for p in (tmp_path / "data" / "exports").glob("stats-*"))
        assert names == [".csv", ".json", ".md", ".svg", ".svg"], names  # the two charts as pictures
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
        # Each chart's picture: an SVG beside the report, linked above its plain-text chart.
        pictures = [p for p in written if p.suffix == ".svg"]
        assert len(pictures) == 2
        for picture in pictures:
            assert f"]({picture.name})" in md
            root = ElementTree.fromstring(picture.read_bytes())
            assert root.tag.endswith("svg") and len(list(root.iter())) > 50  # axes, ticks, lines: a drawn chart
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
    assert sorted(p.name for p in tmp_path.glob("r-*.svg")) == ["r-hit-rate.svg", "r-tps.svg"]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["export", str(bad)]) == 2


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
    lm.set_cache(CacheSettings(mib=1.0, prefetch="next-layer"))
    second = reply()
    session.add(second, 24, 10.0)
    lm.close()
    d = session.to_dict()
    # The prefetch counters (the second cache prefetched) add up too, and the report states them.
    p = d["prefetch"]
    assert p["prefetched"] == second.total.prefetched > 0 and p["prefetch_hits"] == second.total.prefetch_hits
    from moechat.app.export import to_markdown

    assert f"Prefetch: {p['prefetched']} experts uploaded ahead" in to_markdown(d)
    # The recall: the first cache only predicted (no prefetch, no trace: nothing), the second predicted and fetched.
    assert p["predicted"] == second.total.predicted > 0 and p["predicted_used"] == second.total.predicted_used
    assert p["exposed"] == first.total.misses + second.total.misses
    assert f"Look-ahead: {p['predicted']} experts predicted one layer ahead" in to_markdown(d)
    assert [row["predicted"] for row in d["layers"]] == [b.total.predicted for b in second.layers]
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
