"""Per-layer cache numbers as rows of bars: hit rate, misses computed on the CPU, slots held."""

from __future__ import annotations

from moechat.engine.stats import StatsSnapshot
from rich.text import Text
from textual.widgets import Static

from .redraw import update_fixed

BAR = 12  # characters of the hit-rate bar
HEADER = f"{'layer':>5} {'hit rate':<{BAR}} {'%':>4} {'cpu':>7} {'slots':>5}"


def hit_bar(rate: float, width: int = BAR) -> Text:
    filled = round(rate * width)
    # Plain block characters and the 16 ANSI colours: readable without truecolor.
    return Text("█" * filled, style="green") + Text("░" * (width - filled), style="bright_black")


def layer_rows(snap: StatsSnapshot) -> Text:
    """The header and one fixed-width line per layer (a rich Table costs several times more to draw)."""
    out = Text(HEADER, style="bold")
    for ls in snap.layers:
        tot = ls.total
        out.append(f"\n{ls.layer:>5} ")
        out.append_text(hit_bar(tot.hit_rate))
        out.append(f" {100 * tot.hit_rate:>4.0f} {tot.cpu:>7} {ls.occupancy:>5}")
    return out


class LayerStats(Static):
    """One row per MoE layer. Renders only frozen snapshots handed to `show`."""

    DEFAULT_CSS = "LayerStats { height: auto; }"

    def __init__(self, **kw: object) -> None:
        super().__init__("no expert cache yet", **kw)  # type: ignore[arg-type]
        self.snapshot: StatsSnapshot | None = None

    def show(self, snap: StatsSnapshot) -> None:
        self.snapshot = snap
        update_fixed(self, layer_rows(snap), len(snap.layers) + 1)
