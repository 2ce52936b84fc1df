"""What the screens need of the app that shows them: a protocol, so that screens do not import the app
(the app imports its screens)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol, cast

from moechat.app.conversations import Conversation, ConversationStore
from moechat.app.engine_api import ChatEngine
from moechat.app.export import SessionStats
from moechat.app.paths import AppPaths
from moechat.app.settings import Settings
from textual.screen import Screen


class ScreenHost(Protocol):
    engine: ChatEngine
    engine_lock: threading.Lock
    session: SessionStats
    store: ConversationStore
    config_path: Path
    paths: AppPaths
    cache_in_effect: tuple[float, float]
    attached: bool  # the engine is a server's (`moechat attach`): its numbers move without our replies

    @property
    def settings(self) -> Settings: ...

    @settings.setter
    def settings(self, value: Settings) -> None: ...

    def settings_dict(self) -> dict[str, Any]: ...

    def apply_cache_settings(self, mib: float, share: float) -> None: ...

    def save_conversation(self, conv: Conversation) -> None: ...

    def save_session(self) -> None: ...

    def export_all(self, folder: Path | None = None) -> list[Path]: ...


def host_of(screen: Screen[Any]) -> ScreenHost:
    """The app behind a screen: Textual types it as any App; moechat's meets ScreenHost."""
    return cast(ScreenHost, screen.app)
