"""Per-layer cache numbers as rows of bars: hit rate, misses computed on the CPU, slots held."""

from __future__ import annotations

from moechat.engine.stats import StatsSnapshot

from .rows import Row, RowsView

BAR = 12  # characters of the hit-rate bar
HEADER = f"{'layer':>5} {'hit rate':<{BAR}} {'%':>4} {'cpu':>7} {'slots':>5}"


def hit_bar(rate: float, width: int = BAR) -> Row:
    filled = round(rate * width)
    # Plain block characters and the 16 ANSI colours: readable without truecolor.
    return [("█" * filled, "green"), ("░" * (width - filled), "bright_black")]


def layer_rows(snap: StatsSnapshot) -> list[Row]:
    """The header and one fixed-width line per layer."""
    rows: list[Row] = [[(HEADER, "bold")]]
    for ls in snap.layers:
        tot = ls.total
        rows.append([(f"{ls.layer:>5} ", ""), *hit_bar(tot.hit_rate),
                     (f" {100 * tot.hit_rate:>4.0f} {tot.cpu:>7} {ls.occupancy:>5}", "")])  # fmt: skip
    return rows


class LayerStats(RowsView):
    """One row per MoE layer. Renders only frozen snapshots handed to `show`."""

    def __init__(self, **kw: object) -> None:
        super().__init__("no expert cache yet", **kw)
        self.snapshot: StatsSnapshot | None = None

    def show(self, snap: StatsSnapshot) -> None:
        self.snapshot = snap
        self.set_rows(layer_rows(snap))
