"""OpenAI's wire format: requests read and checked, responses and errors in its shapes.

Unknown fields are ignored, as OpenAI's own server does with fields it does not know; fields that
would change the meaning of an answer moechat cannot give (`n` > 1, tools, logprobs, a JSON response
format) are a 400, never a silent wrong answer.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from moechat.engine.events import SamplingParams

MAX_STOPS = 4  # OpenAI's limit on stop sequences


class ApiError(Exception):
    """A request refused: the HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """What a completion request asks of the engine."""

    messages: list[dict[str, str]] | None  # chat: the conversation; None: a raw prompt
    prompt: str | None
    max_tokens: int | None  # None: up to the context
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None


def _get(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # JSON's true is not a number here: bool is a subclass of int in Python.
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ApiError(400, f"'{name}' must be {_kind_name(kinds)}, not a boolean", param=name)
    if not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {_kind_name(kinds)}, not {type(value).__name__}", param=name)
    return value


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}  # fmt: skip
    ks = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in ks))


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    raw = body.get("messages")
    if raw is None:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(raw, list):
        raise ApiError(400, f"'messages' must be an array, not {type(raw).__name__}", param="messages")
    if not raw:
        raise ApiError(400, "'messages' must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"'{where}' must be an object", param=where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"'{where}.role' must be system, developer, user or assistant, not {role!r}",
                           param=f"{where}.role")  # fmt: skip
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):  # fmt: skip
                raise ApiError(400, f"'{where}.content' parts must be text parts here", param=f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"'{where}.content' must be a string", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _refuse_unsupported(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "'n' other than 1 is not supported: moechat writes one choice", param="n")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tools are not supported by this model's chat template here", param="tools")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise ApiError(400, "only the text response format is supported", param="response_format")
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported", param="echo")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported", param="suffix")


def read_request(body: Any, defaults: SamplingParams, n_ctx: int, chat: bool) -> Request:
    """A chat (`chat`) or text completion request, checked; ApiError for anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _refuse_unsupported(body)
    messages = _messages(body) if chat else None
    prompt = None
    if not chat:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if not isinstance(raw, str):
            raise ApiError(400, "'prompt' must be a string", param="prompt")
        prompt = raw
    max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens is not None:  # more than the context holds: the reply ends where the context does ("length")
        max_tokens = min(max_tokens, n_ctx)
    temperature = float(_get(body, "temperature", (int, float), defaults.temperature))
    top_p = float(_get(body, "top_p", (int, float), defaults.top_p))
    seed = _get(body, "seed", int, defaults.seed)
    params = SamplingParams(temperature=temperature, top_k=defaults.top_k, top_p=top_p, min_p=defaults.min_p,
                            repeat_penalty=defaults.repeat_penalty, repeat_last_n=defaults.repeat_last_n,
                            seed=seed)  # fmt: skip
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"'temperature' must be between 0 and 2, got {temperature:g}", param="temperature")
    try:
        params.validate()
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        raise ApiError(400, "'stop' must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"'stop' takes up to {MAX_STOPS} non-empty strings", param="stop")
    stream = bool(_get(body, "stream", bool, False))
    options = _get(body, "stream_options", dict, {})
    model = _get(body, "model", str, None)
    return Request(messages, prompt, max_tokens, params, stops, stream, bool(options.get("include_usage")), model)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the KV cache held from an earlier request as cached ones."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip


def completion(rid: str, model: str, text: str, finish: str, use: dict[str, Any], chat: bool) -> dict[str, Any]:
    """A whole (not streamed) answer."""
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish, "logprobs": None}  # fmt: skip
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use}  # fmt: skip


def chunk(rid: str, model: str, created: int, chat: bool, text: str | None = None, finish: str | None = None,
          role: bool = False, use: dict[str, Any] | None = None,
          no_choice: bool = False) -> dict[str, Any]:  # fmt: skip
    """One streamed piece: a role, text, the finish reason, or (no choice) the usage at the end."""
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model}  # fmt: skip
    if no_choice:
        out["choices"] = []
    elif chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        out["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
    if use is not None:
        out["usage"] = use
    return out
