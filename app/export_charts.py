"""The session report's charts as pictures: SVG files drawn with matplotlib, written beside the Markdown.

The Markdown keeps its plain-text charts (they read in a terminal and in any viewer) and links the
pictures above them. matplotlib is imported only when a report is written, and through its object
API (`Figure`), not pyplot: no global state, no display, safe off the main thread.
"""

from __future__ import annotations

import io
from pathlib import Path

Line = tuple[str, list[float], list[float]]  # label, xs (the session's tokens), ys


def svg_chart(title: str, lines: list[Line], ylabel: str) -> str:
    """One chart as SVG text: each (label, xs, ys) drawn apart, so a line never joins two replies; the
    token axis in whole tokens."""
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.add_subplot()
    colours: dict[str, str] = {}
    for label, xs, ys in lines:
        first = label not in colours
        (drawn,) = ax.plot(xs, ys, marker="." if len(xs) < 40 else None, linewidth=1.4,
                           color=colours.get(label), label=label if first else None)  # fmt: skip
        colours.setdefault(label, to_hex(drawn.get_color()))
    ax.set_title(title)
    ax.set_xlabel("tokens generated in the session")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if len(colours) > 1:
        ax.legend(loc="best", fontsize="small")
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})  # no date: the same session, the same file
    return buf.getvalue()


def picture_names(md_path: Path, keys: list[str]) -> dict[str, Path]:
    """Where each chart's picture goes: beside the report, named after it."""
    return {k: md_path.with_name(f"{md_path.stem}-{k}.svg") for k in keys}
