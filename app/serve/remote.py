"""A `ChatEngine` on the far side of `moechat serve`: what `moechat attach` gives the chat app.

The app runs unchanged: its chat pane talks to the server like any client (OpenAI's streamed chat
completions), and its dashboard draws the server's own snapshots (/moechat/stats), the very type the
engine process sends the chat app. No torch here: this runs in the UI process. The tuning wizard
and cache changes measure and change the server's machine, so they are not offered from here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import httpx
from moechat.app.engine_api import Message, ModelInfo
from moechat.engine.cache.stats import StatsSnapshot, snapshot_from_dict
from moechat.engine.events import BatchStatus, DoneEvent, Event, SamplingParams, TokenEvent
from moechat.tuner.baselines import MinBound


class RemoteEngine:
    def __init__(self, url: str, api_key: str | None = None) -> None:
        base = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=base, headers=headers, timeout=httpx.Timeout(30.0, read=None))
        d = self._get("/moechat/info")
        self.info = ModelInfo(**d["model"])
        self._cache = (float(d["cache"][0]), float(d["cache"][1]))
        self._messages: list[Message] = []
        self.live_tokens, self.live_tps = 0, 0.0  # the server's reply now or last (anyone's)
        self.live_batch: BatchStatus | None = None  # its slots and decode steps now

    def _get(self, path: str) -> dict[str, Any]:
        try:
            r = self._client.get(path)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach the server at {self._client.base_url}: {e}") from e
        if r.status_code != 200:
            raise ValueError(f"the server at {self._client.base_url} answered {path} with {r.status_code}: "
                             f"{_error(r)}")  # fmt: skip
        return r.json()

    def fit_messages(self, messages: Sequence[Message]) -> tuple[list[int], int, str]:
        """The server fits the conversation itself: kept for the reply that follows."""
        self._messages = list(messages)
        return [], 0, ""

    def reply(self, prompt: list[int], params: SamplingParams, max_tokens: int, stop: threading.Event,
              stops: Sequence[str] = ()) -> Iterator[Event]:  # fmt: skip
        body = {"messages": self._messages, "max_tokens": min(max_tokens, self.info.n_ctx),  # the server clamps
                "temperature": params.temperature,
                "top_p": params.top_p, "seed": params.seed, "stream": True,
                "stream_options": {"include_usage": True}, **({"stop": list(stops)} if stops else {})}  # fmt: skip
        t0 = time.perf_counter()
        last = first = 0.0
        n, finish, usage = 0, "length", {"prompt_tokens": 0, "completion_tokens": 0}
        with self._client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise ValueError(f"the server answered {r.status_code}: {_error(r)}")
            for line in r.iter_lines():
                if stop.is_set():  # closing the stream stops the server's generation
                    finish = "stopped"
                    break
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ValueError(f"the server failed mid-reply: {chunk['error'].get('message')}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        now = time.perf_counter()
                        first = first or now
                        yield TokenEvent(0, text, n, now - (last or t0))
                        last, n = now, n + 1
                    if choice.get("finish_reason"):
                        finish = "eos" if choice["finish_reason"] == "stop" else "length"
        end = time.perf_counter()
        yield DoneEvent(usage["prompt_tokens"], usage["completion_tokens"] or n, (first or end) - t0,
                        end - (first or end), finish)  # fmt: skip

    def snapshot(self) -> StatsSnapshot | None:
        d = self._get("/moechat/stats")
        self.live_tokens, self.live_tps = int(d.get("tokens", 0)), float(d.get("tps", 0.0))
        b = d.get("batch")
        self.live_batch = replace(BatchStatus(**b), slot_tps=tuple(b["slot_tps"])) if b else None
        return snapshot_from_dict(d["snapshot"]) if d.get("snapshot") else None

    def cache(self) -> tuple[float, float]:
        return self._cache

    def min_bound(self) -> MinBound | None:
        return None

    def close(self) -> None:
        self._client.close()


def _error(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
