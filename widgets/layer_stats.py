"""Per-layer cache numbers as rows of bars: hit rate, misses computed on the CPU, slots held."""

from __future__ import annotations

from moechat.engine.stats import StatsSnapshot
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

BAR = 12  # characters of the hit-rate bar


def hit_bar(rate: float, width: int = BAR) -> Text:
    filled = round(rate * width)
    # Plain block characters and the 16 ANSI colours: readable without truecolor.
    return Text("█" * filled, style="green") + Text("░" * (width - filled), style="bright_black")


class LayerStats(Static):
    """One row per MoE layer. Renders only frozen snapshots handed to `show`."""

    DEFAULT_CSS = "LayerStats { height: auto; }"

    def __init__(self, **kw: object) -> None:
        super().__init__("no expert cache yet", **kw)  # type: ignore[arg-type]
        self.snapshot: StatsSnapshot | None = None

    def show(self, snap: StatsSnapshot) -> None:
        self.snapshot = snap
        t = Table(box=None, padding=(0, 1), expand=False, show_edge=False)
        t.add_column("layer", justify="right")
        t.add_column("hit rate")
        t.add_column("%", justify="right")
        t.add_column("cpu", justify="right")
        t.add_column("slots", justify="right")
        for ls in snap.layers:
            tot = ls.total
            t.add_row(
                str(ls.layer), hit_bar(tot.hit_rate), f"{100 * tot.hit_rate:.0f}", str(tot.cpu), str(ls.occupancy)
            )
        self.update(t)
