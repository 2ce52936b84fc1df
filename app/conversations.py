"""Conversations on disk: one JSON file each under the data dir, written atomically.

A file that cannot be read (corrupt, half written by a crash of another program) is moved into
`corrupt/` next to the others with a warning, never overwritten or deleted.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from moechat.app.atomic import write_atomic

logger = logging.getLogger(__name__)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6])
    created: str = field(default_factory=now_iso)
    updated: str = field(default_factory=now_iso)
    model: str = ""
    system: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)  # role, content, and for replies: stopped, stats

    @property
    def title(self) -> str:
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "(empty)")
        line = first.strip().splitlines()[0] if first.strip() else "(empty)"
        return line[:60]

    def chat_messages(self) -> list[dict[str, str]]:
        """What the template renders: the system prompt and the turns, without our bookkeeping."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        return out + [{"role": m["role"], "content": m["content"]} for m in self.messages]


class ConversationStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, conv_id: str) -> Path:
        return self.root / f"{conv_id}.json"

    def save(self, conv: Conversation) -> Path:
        conv.updated = datetime.now(UTC).isoformat(timespec="microseconds")  # orders saves within a second
        return write_atomic(self.path(conv.id), json.dumps(asdict(conv), indent=1, ensure_ascii=False))

    def load(self, conv_id: str) -> Conversation:
        path = self.path(conv_id)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            conv = Conversation(**data)
            if not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in conv.messages):
                raise ValueError("a message lacks role or content")
            return conv
        except (OSError, ValueError, TypeError) as e:
            self._set_aside(path, e)
            raise ValueError(
                f"conversation {conv_id} could not be read ({e}); it was moved to {self.root / 'corrupt'}"
            ) from None

    def list(self) -> list[Conversation]:
        """Readable conversations, newest first; unreadable ones are set aside with a warning."""
        out: list[Conversation] = []
        if not self.root.is_dir():
            return out
        for path in self.root.glob("*.json"):
            try:
                out.append(self.load(path.stem))
            except ValueError as e:
                logger.warning("%s", e)
        return sorted(out, key=lambda c: c.updated, reverse=True)

    def _set_aside(self, path: Path, why: Exception) -> None:
        if not path.exists():
            return
        aside = self.root / "corrupt"
        aside.mkdir(parents=True, exist_ok=True)
        os.replace(path, aside / path.name)
        logger.warning("%s could not be read (%s): kept in %s", path.name, why, aside)
