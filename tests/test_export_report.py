"""The session report's figures and charts: rates weighted by tokens, charts on the session's token
axis that never fold back, a legend that says which line is which; the run summary's words."""

from __future__ import annotations

from moechat.app.export import SessionStats, _by_reply, to_markdown
from moechat.engine.cache.stats import (
    CountersSnapshot,
    GroupInfo,
    LayerSnapshot,
    StatsSnapshot,
    summary_lines,
)
from moechat.engine.kernels.jit import compile_line


def _snap(tokens: int, hits: int, lookups: int) -> StatsSnapshot:
    small = CountersSnapshot(lookups=lookups, hits=hits, misses=lookups - hits, tokens=tokens)
    layer = LayerSnapshot(0, 0, small, CountersSnapshot(), 4, (0, 1), (1, 1))
    return StatsSnapshot(0.0, tokens, (GroupInfo(0, (0,), 8, 1, 4, 4),), (layer,), 0.0)


def _session() -> SessionStats:
    """Two replies: 10 tokens at 10 t/s (1 s), then 100 tokens at 50 t/s (2 s)."""
    s = SessionStats({"name": "m.gguf", "arch": "qwen3moe", "device": "cpu"}, {})
    for n in (4, 8, 10):
        s.add(_snap(n, n, 2 * n), n, 10.0)
    s.replies.append({"n_prompt": 20, "n_generated": 10, "prompt_tps": 100.0, "gen_tps": 10.0})
    for n in (40, 80, 100):
        s.add(_snap(10 + n, 10 + n, 2 * (10 + n)), n, 50.0)
    s.replies.append({"n_prompt": 40, "n_generated": 100, "prompt_tps": 400.0, "gen_tps": 50.0})
    return s


def test_rates_are_weighted_by_tokens() -> None:
    md = to_markdown(_session().to_dict())
    # 110 tokens in 3 s, not the mean of 10 and 50 t/s; 60 prompt tokens in 0.3 s. Beside them the median
    # reply's rate, which one slow reply does not drag down.
    assert "| tg55 | 36.67 | 30.00 |" in md, md
    assert "| pp30 | 200.00 | 250.00 |" in md, md


def test_the_series_runs_on_the_session_axis_one_line_per_reply() -> None:
    d = _session().to_dict()
    assert [p["session_tokens"] for p in d["series"]] == [4, 8, 10, 50, 90, 110]
    assert [p["reply"] for p in d["series"]] == [1, 1, 1, 2, 2, 2]
    parts = _by_reply(d["series"])
    assert [xs for xs, _ in parts] == [[4.0, 8.0, 10.0], [50.0, 90.0, 110.0]]
    # An export written before points carried the session's tokens: the replies follow each other too.
    old = [{"tokens": n} for n in (4, 8, 10, 3, 9)]
    assert [xs for xs, _ in _by_reply(old)] == [[4.0, 8.0, 10.0], [13.0, 19.0]]
    md = to_markdown(d)
    assert "tokens generated in the session" in md and "since the cache's start" in md
    # The x axis' labels rise from left to right: no reply starts over at 0 after a later one.
    assert "tokens/s of each reply, on the session's token axis" in md


def test_a_batch_class_without_lookups_says_so_instead_of_a_zero_hit_rate() -> None:
    bypassed = CountersSnapshot(bypassed=12, calls=2, tokens=40)
    used = CountersSnapshot(lookups=10, hits=7, misses=3, tokens=5)
    snap = StatsSnapshot(0.0, 45, (GroupInfo(0, (0,), 8, 1, 4, 4),),
                         (LayerSnapshot(0, 0, used, bypassed, 4, (), ()),), 0.0)  # fmt: skip
    small, large = summary_lines(snap)
    assert "hit rate = 70.0%" in small
    assert "hit rate = none (every lookup bypassed)" in large and "0.0%" not in large.split("uploaded")[0]


def test_compile_progress_counts_without_a_total_that_could_drift() -> None:
    first, later = compile_line(1), compile_line(150)
    assert first == "compiling kernels for this model (first start only, a minute or two on 2 cores): 1 compiled"
    assert later.endswith(": 150 compiled") and "of about" not in later


def test_token_axes_are_ticked_in_whole_tokens() -> None:
    """The dashboard's chart and the report's: plotext's own ticks fell on fractions of a token."""
    from moechat.widgets.ticks import whole_ticks

    assert whole_ticks([1, 2, 3]) == [1, 2, 3]
    assert whole_ticks([0.5, 7.2]) == [0, 2, 4, 6, 8]
    assert whole_ticks([3, 130]) == [50, 100] and whole_ticks([0, 1234]) == [0, 500, 1000]
    assert whole_ticks([5, 5]) == [5]
    for lo, hi in ((0, 17), (12, 1000), (7, 9)):
        ticks = whole_ticks([lo, hi], most=6)
        assert all(isinstance(t, int) for t in ticks) and len(ticks) <= 6 and lo <= ticks[0] <= ticks[-1] <= hi
