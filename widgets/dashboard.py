"""The live cache dashboard: totals, per-layer bars, the throughput plot and the expert heat map."""

from __future__ import annotations

from moechat.engine.stats import StatsSnapshot
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from .expert_heatmap import ExpertHeatmap
from .layer_stats import LayerStats
from .throughput import ThroughputPlot


class Dashboard(VerticalScroll):
    DEFAULT_CSS = """
    Dashboard { width: 46; border-left: solid $primary; padding: 0 1; }
    Dashboard > .title { text-style: bold; }
    Dashboard > #totals { height: 3; }
    """

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.updates = 0  # snapshots shown: tests check the rate stays bounded

    def compose(self) -> ComposeResult:
        yield Static("expert cache", classes="title")
        yield Static("waiting for the first tokens", id="totals")
        yield ThroughputPlot(id="tps")
        yield Static("per layer", classes="title")
        yield LayerStats(id="layers")
        yield Static("experts by use (reverse = cached)", classes="title")
        yield ExpertHeatmap(id="heatmap")

    def show(
        self, snap: StatsSnapshot | None, tokens: int, tps: float, uploaded_per_token_mib: float, final: bool = False
    ) -> None:
        self.updates += 1
        if tps > 0:
            self.query_one(ThroughputPlot).add(tokens, tps, final=final)
        if snap is None:
            self.query_one("#totals", Static).update(f"no expert cache  |  {tps:.1f} t/s", layout=False)
            return
        t = snap.total
        self.query_one("#totals", Static).update(
            f"hit rate {100 * t.hit_rate:.1f}%  |  {tps:.1f} t/s\n"
            f"cpu misses {t.cpu}  |  uploaded {t.uploaded_bytes / 2**20:.1f} MiB "
            f"({uploaded_per_token_mib:.2f} MiB/token)\n"
            f"share {snap.cpu_share:g}  |  slots " + ", ".join(f"{g.n_slots}" for g in snap.groups),
            layout=False,  # a fixed 3 lines: no relayout of the screen for each update
        )
        if not self.display:
            return  # hidden: the totals above stay current, the costlier parts wait
        self.query_one(LayerStats).show(snap)
        self.query_one(ExpertHeatmap).show(snap, final=final)
