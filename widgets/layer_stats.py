"""Per-layer cache numbers as rows of bars: hit rate, misses computed on the CPU (with look-ahead: misses, those
exposed and the prediction's recall), slots held."""

from __future__ import annotations

from collections.abc import Sequence

from moechat.engine.cache.stats import CountersSnapshot, LayerSnapshot, StatsSnapshot
from moechat.widgets.rows import Row, RowsView

BAR = 12  # characters of the hit-rate bar
HEADER = f"{'layer':>5} {'hit rate':<{BAR}} {'%':>4} {'cpu':>7} {'slots':>5}"
BAR_AHEAD = 8  # with look-ahead: room for the misses, the exposed ones and the recall
HEADER_AHEAD = f"{'layer':>5} {'hit rate':<{BAR_AHEAD}} {'%':>4} {'miss':>5} {'expos':>5} {'rec':>4} {'slots':>5}"


def hit_bar(rate: float, width: int = BAR) -> Row:
    filled = round(rate * width)
    # Plain block characters and the 16 ANSI colours: readable without truecolor.
    return [("█" * filled, "green"), ("░" * (width - filled), "bright_black")]


def fold_layers(layers: Sequence[LayerSnapshot], fold: int) -> list[tuple[str, list[LayerSnapshot]]]:
    """Runs of `fold` consecutive layers, each with its label ("7", or "6-7" for a run)."""
    out = []
    for i in range(0, len(layers), max(1, fold)):
        run = list(layers[i : i + max(1, fold)])
        label = str(run[0].layer) if len(run) == 1 else f"{run[0].layer}-{run[-1].layer}"
        out.append((label, run))
    return out


def layer_rows(snap: StatsSnapshot, fold: int = 1) -> list[Row]:
    """The header and one fixed-width line per layer (per run of `fold` layers, their sums). With look-ahead
    (predictions counted): a shorter bar, the misses before prefetch, those exposed and the recall."""
    ahead = any(ls.total.predicted for ls in snap.layers)
    rows: list[Row] = [[(HEADER_AHEAD if ahead else HEADER, "bold")]]
    for label, run in fold_layers(snap.layers, fold):
        tot = sum((ls.total for ls in run), CountersSnapshot())
        slots = sum(ls.occupancy for ls in run)
        if ahead:
            recall = f"{100 * tot.recall:>3.0f}%" if tot.predicted else "   -"
            rows.append(
                [
                    (f"{label:>5} ", ""),
                    *hit_bar(tot.hit_rate, BAR_AHEAD),
                    (f" {100 * tot.hit_rate:>4.0f} {tot.missed:>5} {tot.exposed:>5} {recall} {slots:>5}", ""),
                ]
            )
            continue
        rows.append([(f"{label:>5} ", ""), *hit_bar(tot.hit_rate),
                     (f" {100 * tot.hit_rate:>4.0f} {tot.cpu:>7} {slots:>5}", "")])  # fmt: skip
    return rows


class LayerStats(RowsView):
    """One row per MoE layer. Renders only frozen snapshots handed to `show`."""

    def __init__(self, **kw: object) -> None:
        super().__init__("no expert cache yet", **kw)
        self.snapshot: StatsSnapshot | None = None

    def show(self, snap: StatsSnapshot, fold: int = 1) -> None:
        self.snapshot = snap
        self.set_rows(layer_rows(snap, fold))
