"""Stop strings cut from a streamed reply: torch-free, so the server's HTTP process (app/serve) and the
engine's reply path share it without the server loading the engine."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Cuts a streamed reply at the first stop string, holding back text that could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in stops), default=0)
        self.text = ""
        self.shown = 0
        self.hit = False

    def push(self, piece: str) -> str:
        """The new text that is safe to show (nothing once a stop string was found: tokens the engine
        still wrote before it saw the stop are not part of the reply)."""
        if self.hit:
            return ""
        self.text += piece
        for s in self.stops:
            cut = self.text.find(s)
            if cut >= 0:
                self.text, self.hit = self.text[:cut], True
        safe = len(self.text) if self.hit else max(self.shown, len(self.text) - self.hold)
        out, self.shown = self.text[self.shown : safe], safe
        return out

    def flush(self) -> str:
        out, self.shown = self.text[self.shown :], len(self.text)
        return out
