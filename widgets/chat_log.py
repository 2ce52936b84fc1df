"""The chat's widgets: the input, the turns of the conversation (Markdown that streams cheaply) and
the marker above the oldest turn shown."""

from __future__ import annotations

from typing import Any

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.visual import VisualType
from textual.widgets import Markdown, Static, TextArea

# MarkdownParagraph is not exported: tests/test_tui_chat.py checks that Markdown still builds its
# paragraphs from this class, so a Textual that changes it fails there, not on a user's screen.
from textual.widgets._markdown import MarkdownParagraph

__all__ = ["ChatInput", "EarlierMarker", "MarkdownParagraph", "ReplyMarkdown", "StreamedParagraph", "Turn", "turn_for"]


class ChatInput(TextArea):
    """Enter sends; Shift+Enter or Ctrl+J adds a newline; Up on the first line recalls earlier prompts."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, **kw: Any) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, **kw)
        self.prompt_history: list[str] = []
        self.recall = -1

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text:
                self.prompt_history.append(text)
                self.recall = -1
                self.post_message(self.Submitted(text))
                self.clear()
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "up" and self.cursor_location[0] == 0 and self.prompt_history:
            event.stop()
            event.prevent_default()
            self.recall = len(self.prompt_history) - 1 if self.recall < 0 else max(0, self.recall - 1)
            self.load_text(self.prompt_history[self.recall])
            return
        await super()._on_key(event)


class StreamedParagraph(MarkdownParagraph):
    """A paragraph that relays out the screen only when its height changes.

    Each streamed append updates the reply's last paragraph, and an update relays out the whole
    screen (2.5 ms here) though most appends only add words to its last line: skipping those
    took the UI from 9.3-9.5% to 8.1-8.6% of a core while streaming (scripted engine, A/B).
    """

    def update(self, content: VisualType = "", *, layout: bool = True) -> None:
        width, height = self.content_region.size
        if layout and width > 0 and isinstance(content, Content):
            # As Textual's Widget measures a visual: with its styles as the rules.
            layout = content.get_height(self.styles, width) != height  # type: ignore[arg-type]
        super().update(content, layout=layout)


class ReplyMarkdown(Markdown):
    """A turn's Markdown, whose paragraphs are StreamedParagraphs (Markdown builds blocks from BLOCKS)."""

    def __init__(self, markdown: str | None = None) -> None:
        super().__init__(markdown)
        self.BLOCKS = {**Markdown.BLOCKS, "paragraph_open": StreamedParagraph}


class Turn(Vertical):
    DEFAULT_CSS = """
    Turn { height: auto; margin: 0 0 1 0; }
    Turn > .role { text-style: bold; color: $accent; }
    Turn.user > .role { color: $success; }
    Turn > Markdown { margin: 0; padding: 0 1; }
    """

    def __init__(self, role: str, content: str, note: str = "") -> None:
        super().__init__(classes=role)
        self.role, self.content, self.note = role, content, note

    def compose(self) -> ComposeResult:
        yield Static(self.role + (f"  [{self.note}]" if self.note else ""), classes="role", markup=False)
        yield ReplyMarkdown(self.content)

    def set_note(self, note: str) -> None:
        self.note = note
        self.query_one(".role", Static).update(self.role + (f"  [{note}]" if note else ""))


def turn_for(message: dict[str, Any]) -> Turn:
    return Turn(message["role"], message["content"], "stopped" if message.get("stopped") else "")


class EarlierMarker(Static):
    """Above the oldest turn shown: how many earlier ones there are; a click brings some back."""

    DEFAULT_CSS = "EarlierMarker { color: $text-muted; text-align: center; }"

    class Clicked(Message):
        """The user asked for earlier turns."""

    def on_click(self) -> None:
        self.post_message(self.Clicked())
