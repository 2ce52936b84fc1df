"""Fixed rows of styled text drawn through Textual's Line API: the dashboard's cheap text widget.

A Static turns its text into a Content, wraps it and styles it on every update (about 3.5 ms for
the 19 layer rows, measured while streaming). The dashboard's rows never wrap and use a few plain
styles, so each row becomes one Strip of ready-made segments, built once per update.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget

Run = tuple[str, str]  # (text, rich style string, "" for the widget's own)
Row = list[Run]


@lru_cache(maxsize=64)
def _style(spec: str) -> Style:
    return Style.parse(spec) if spec else Style()


def plain(row: Sequence[Run]) -> str:
    return "".join(text for text, _ in row)


class RowsView(Widget):
    """One line per row, never wrapped; the screen relays out only when the number of rows changes."""

    DEFAULT_CSS = "RowsView { height: auto; }"

    def __init__(self, placeholder: str = "", **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self._rows: list[Row] = [[(placeholder, "")]]
        self._strips: list[Strip] = []
        self._key: tuple[int, Style] | None = None  # (width, base style) the strips were built for

    @property
    def lines(self) -> list[str]:
        """The rows as plain text, as drawn."""
        return [plain(row) for row in self._rows]

    def set_rows(self, rows: Sequence[Row]) -> None:
        resized = len(rows) != len(self._rows)
        self._rows = list(rows)
        self._key = None
        self.refresh(layout=resized)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._rows)

    def render_line(self, y: int) -> Strip:
        width, base = self.size.width, self.visual_style.rich_style
        if self._key != (width, base):
            self._key = (width, base)
            self._strips = [
                Strip([Segment(text, base + _style(spec)) for text, spec in row if text]).crop_extend(0, width, base)
                for row in self._rows
            ]
        if 0 <= y < len(self._strips):
            return self._strips[y]
        return Strip.blank(width, base)
