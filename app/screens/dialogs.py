"""Small modal dialogs: reopen a conversation, edit the system prompt and sampling."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from moechat.app.conversations import Conversation
from moechat.app.screens.host import ScreenHost, host_of
from moechat.app.settings import SettingError, Settings, coerce
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

DIALOG_CSS = """
ModalScreen { align: center middle; }
ModalScreen > Vertical { width: 70; max-width: 95%; height: auto; max-height: 90%; border: thick $primary;
                         background: $surface; padding: 1 2; }
"""


class OpenChat(ModalScreen[Conversation | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Back")]
    DEFAULT_CSS = DIALOG_CSS

    def __init__(self, conversations: list[Conversation]) -> None:
        super().__init__()
        self.conversations = conversations

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("Reopen a conversation" if self.conversations else "No saved conversations yet")
            # Titles are the user's own words: shown as written, never read as markup.
            yield OptionList(*[Option(Content(f"{c.updated[:16]}  {c.title}"), id=c.id) for c in self.conversations])

    @on(OptionList.OptionSelected)
    def chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(next(c for c in self.conversations if c.id == event.option.id))


EDITABLE = ("system", "temp", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "n_predict")


class SettingsDialog(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(False)", "Back")]
    DEFAULT_CSS = DIALOG_CSS + "Input { margin: 0 0 1 0; }"

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings

    @property
    def moechat(self) -> ScreenHost:
        return host_of(self)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("System prompt and sampling (this session)")
            for name in EDITABLE:
                yield Static(name.replace("_", " "))
                yield Input(str(getattr(self.settings, name)), id=f"set-{name}")
            yield Static("", id="error", markup=False)
            yield Button("Apply", id="apply", variant="primary")

    @on(Button.Pressed, "#apply")
    @on(Input.Submitted)
    def apply(self) -> None:
        values: dict[str, Any] = {}
        try:
            for name in EDITABLE:
                raw = self.query_one(f"#set-{name}", Input).value
                values[name] = coerce(name, raw, "the settings dialog")
        except SettingError as e:
            self.query_one("#error", Static).update(str(e))
            return
        self.moechat.settings = replace(self.moechat.settings, **values)
        self.dismiss(True)
