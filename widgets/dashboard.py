"""The live cache dashboard: totals, per-layer bars, the throughput plot and the expert heat map."""

from __future__ import annotations

from moechat.engine.cache.stats import Recent, StatsSnapshot, TierSnapshot
from moechat.engine.events import BatchStatus
from moechat.tuner.baselines import MinBound
from moechat.widgets.expert_heatmap import ExpertHeatmap, axis, legend
from moechat.widgets.layer_stats import LayerStats
from moechat.widgets.rows import RowsView
from moechat.widgets.throughput import ThroughputPlot
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

# The totals' title says what they cover (the session's export always adds up every cache it ran).
SCOPES = {False: "expert cache (this session)", True: "expert cache (since the last change)"}


def ram_rows(r: TierSnapshot) -> list[str]:
    """The RAM tier's lines: its hit rate, what it read and waited for, and its look-ahead."""
    return [
        f"RAM {100 * r.hit_rate:.1f}%  |  read {r.bytes_read / 2**20:.0f} MiB  |  wait {r.wait_s:.1f} s",
        f"read ahead {r.prefetched} ({r.prefetch_used} used)  |  recall {100 * r.recall:.0f}%",
    ]


def batch_rows(b: BatchStatus) -> list[str]:
    """An attached server's slots: how many are busy and queued, the last decode step, each slot's t/s."""
    return [
        f"server {b.active}/{b.slots} slots  |  {b.queued} queued  |  step {b.last_batch}",
        "slot t/s " + " ".join(f"{v:.1f}" for v in b.slot_tps),
    ]


class Dashboard(VerticalScroll):
    DEFAULT_CSS = """
    Dashboard { width: 46; border-left: solid $primary; padding: 0 1; }
    Dashboard > .title { text-style: bold; }
    """

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.updates = 0  # snapshots shown: tests check the rate stays bounded
        self._bound: MinBound | None = None  # MIN's hit rate and the cache's after the last reply
        self._totals: tuple[float, float, Recent | None] = (0.0, 0.0, None)  # t/s, MiB/token, recent window
        self._snap: StatsSnapshot | None = None  # the latest, to fold again on a resize
        self.off_note = ""  # why there is no cache (auto's words), shown where the cache's numbers would be
        self.server_rows: list[str] = []  # an attached server's slots (`batch_rows`), above the cache's numbers
        # What a miss's copy into a slot is: an upload over the link to a GPU; on the CPU device a copy
        # within RAM ("copied": the same bookkeeping, no link), which "uploaded" would misname.
        self.copied = "uploaded"

    def compose(self) -> ComposeResult:
        yield Static(SCOPES[False], classes="title", id="cache-title")
        yield RowsView("waiting for the first tokens", id="totals")
        yield ThroughputPlot(id="tps")
        yield Static("per layer", classes="title")
        yield LayerStats(id="layers")
        yield Static(legend(), id="heat-legend")
        yield RowsView("  L", id="heat-axis")  # rows are cropped at the panel's edge, never wrapped
        yield ExpertHeatmap(id="heatmap")

    def show(
        self, snap: StatsSnapshot | None, tokens: int, tps: float, uploaded_per_token_mib: float, full: bool = True,
        recent: Recent | None = None,
    ) -> None:  # fmt: skip
        """`full`: the plot and the heat map redraw too (the publisher decides how often).

        `recent`: the counters over the last tokens (the session's RecentWindow), None until it has a span."""
        self.updates += 1
        self._snap = snap
        if tps > 0:
            self.query_one(ThroughputPlot).add(tokens, tps, redraw=full)
        self._totals = (tps, uploaded_per_token_mib, recent)
        self._show_totals()
        if snap is not None and snap.groups:
            self._show_layers(snap, full)

    def _show_totals(self) -> None:
        snap, (tps, uploaded_per_token_mib, recent) = self._snap, self._totals
        totals = self.query_one("#totals", RowsView)
        server = [[(line, "")] for line in self.server_rows]
        if snap is None or (not snap.groups and snap.ram is not None):
            rows = [[(f"no expert cache  |  {tps:.1f} t/s", "")]]
            if snap is not None and snap.ram is not None:  # the experts in a RAM tier, read from the file
                rows += [[(line, "")] for line in ram_rows(snap.ram)]
            totals.set_rows(server + rows + ([[(self.off_note, "")]] if self.off_note else []))
            return
        t = snap.total
        if recent is None:
            last = "last tokens: after the next update"
        else:
            worst = ", ".join(f"{layer} {100 * rate:.0f}%" for layer, rate in recent.worst(2))
            last = f"last {recent.span} tok {100 * recent.total.hit_rate:.1f}%  |  worst {worst}"
        # MIN's hit rate at this size, on the lookups up to the last reply: the bound of any policy. On a
        # long session it covers a window of recent lookups, shown with the cache's own rate on them.
        b = self._bound
        bound = f" (MIN {100 * b.rate:.1f}%)" if b is not None and b.from_start else ""
        window = [] if b is None or b.from_start else [
            [(f"last {b.tokens} tok {100 * b.hit_rate:.1f}% (MIN {100 * b.rate:.1f}%)", "")]]  # fmt: skip
        # Short lines that fit the panel's 43 columns: rows are cropped, never wrapped.
        totals.set_rows([
            *server,
            [(f"hit rate {100 * t.hit_rate:.1f}%" + bound + f"  |  {tps:.1f} t/s", "")],
            [(last, "")],
            *window,
            [(f"{self.copied} {t.uploaded_bytes / 2**20:.1f} MiB  |  {uploaded_per_token_mib:.2f} MiB/token", "")],
            [(f"cpu misses {t.cpu}  |  share {snap.cpu_share:g}", "")],
            [("slots " + ", ".join(f"{g.n_slots}" for g in snap.groups)
              + (f"  |  warm start {snap.warm_uploads}" if snap.warm_uploads else "")
              + (f"  |  {snap.policy}" if snap.policy != "classlru" else "")
              + (f"  |  prefetch {t.prefetch_hits}/{t.prefetched}" if t.prefetched else ""), "")],
            *([[(f"look-ahead recall {100 * t.recall:.0f}%  |  exposed {t.exposed}/{t.missed}", "")]]
              if t.predicted else []),
            *([[(line, "")] for line in ram_rows(snap.ram)] if snap.ram is not None else []),
        ])  # fmt: skip

    def show_scope(self, since_change: bool) -> None:
        """What the totals cover: the whole session, or the cache in use since the last cache change
        (the exports add every cache of the session up)."""
        self.query_one("#cache-title", Static).update(SCOPES[since_change])

    def show_bound(self, bound: MinBound | None) -> None:
        """MIN's hit rate at this cache size and the cache's, on the same lookups: how far the policy is from it."""
        self._bound = bound
        self._show_totals()

    def on_resize(self) -> None:
        # A new panel height can change how many layers share a row: fold again, without a new point.
        if self._snap is not None:
            self._show_layers(self._snap, full=True)

    def _show_layers(self, snap: StatsSnapshot, full: bool) -> None:
        if not self.display:
            return  # hidden: the totals stay current, the costlier parts wait
        fold = self.layer_fold(len(snap.layers))
        self.query_one(LayerStats).show(snap, fold)
        self.query_one(ExpertHeatmap).show(snap, redraw=full, fold=fold)
        if full:
            self.query_one("#heat-axis", RowsView).set_rows([[(axis(snap, fold_rows=fold), "")]])

    def layer_fold(self, n_layers: int) -> int:
        """Layers per row, so that the per-layer rows and the heat map fit the panel without scrolling.

        Rows are folded, never scaled: a row of a run of layers shows their sums (per layer) and
        the busiest of them per expert (heat map). 1 until the panel has a size.
        """
        stats, heat = self.query_one(LayerStats), self.query_one(ExpertHeatmap)
        axis = self.query_one("#heat-axis", RowsView)
        height = self.scrollable_content_region.height
        if height <= 0 or n_layers == 0:
            return 1
        # Rows views by their rows (a layout may not have caught up with their last update yet).
        fixed = sum(len(w.lines) if isinstance(w, RowsView) else w.outer_size.height
                    for w in self.children if w not in (stats, heat, axis))  # fmt: skip
        spare = height - fixed - 1  # less the stats' header
        # The heat map's expert axis where a row each for the stats and the map is left beside it.
        axis.display = spare >= 3
        rows = (spare - (1 if axis.display else 0)) // 2  # the same number of rows for each
        return max(1, -(-n_layers // max(1, rows)))
