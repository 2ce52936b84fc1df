"""Chat templates: Jinja from the GGUF (`tokenizer.chat_template`), rendered in a sandbox.

A template inside a downloaded model file is untrusted code. It runs in Jinja's
`ImmutableSandboxedEnvironment` (no attribute walks to `__class__`, `__globals__` and the
like, no mutation of our objects), with bounds on string sizes it may build and on the size
of what it returns. Any failure becomes a `ChatTemplateError` with one clear line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import resource
import select
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

logger = logging.getLogger(__name__)

MAX_OUTPUT_CHARS = 4_000_000
MAX_STRING_CHARS = 1_000_000
MAX_RENDER_SECONDS = 2.0  # a template that loops longer than this is a denial of service
RENDER_MEMORY_BYTES = 512 << 20  # what a rendering child may allocate beyond what it inherits
ISOLATE = True  # render in a forked child (POSIX); tests of the in-process bounds turn it off
TEMPLATE_FILE = "<template>"  # the file name of code Jinja compiles from a string

# Used when a model has no template: plain, readable turns that base models continue well.
PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """A template that cannot be compiled or rendered safely."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus a cap on strings built by `*` and `**`."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError("exponent too large")
            return operator.pow(left, right)
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_STRING_CHARS:
                raise SecurityError("repetition builds a value too large")
        return operator.mul(left, right)


def _render_forked(template: ChatTemplate, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, send the result, exit without running any cleanup of the parent's
        status = 0
        try:
            os.close(read_fd)
            _cap_memory(RENDER_MEMORY_BYTES)
            payload = b"O" + template.render_here(messages, add_generation_prompt=add_generation_prompt).encode()
        except ChatTemplateError as e:
            payload = b"E" + str(e).encode()
        except MemoryError:
            payload = b"E" + f"chat template ({template.origin}) used too much memory".encode()
        except BaseException as e:
            payload = b"E" + f"chat template ({template.origin}) failed: {type(e).__name__}".encode()
        try:
            with os.fdopen(write_fd, "wb") as f:
                f.write(payload)
        except BaseException:
            status = 1
        os._exit(status)
    os.close(write_fd)
    chunks = []
    deadline = time.monotonic() + MAX_RENDER_SECONDS
    try:
        with os.fdopen(read_fd, "rb") as f:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([f], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    late = f"ran longer than {MAX_RENDER_SECONDS:g} s"
                    raise ChatTemplateError(f"chat template ({template.origin}) {late}")
                chunk = os.read(f.fileno(), 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                if sum(map(len, chunks)) > 4 * MAX_OUTPUT_CHARS + 1:
                    os.kill(pid, signal.SIGKILL)
                    raise ChatTemplateError(f"chat template ({template.origin}) produced too much output")
    finally:
        os.waitpid(pid, 0)
    data = b"".join(chunks)
    if not data:
        raise ChatTemplateError(f"chat template ({template.origin}) failed: the renderer died")
    text = data[1:].decode("utf-8", errors="replace")
    if data[:1] == b"E":
        raise ChatTemplateError(text)
    return text


def _cap_memory(extra: int) -> None:
    """Limit this (child) process's address space to what it maps now plus `extra` bytes."""
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return
    limit = size + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now(timezone.utc).strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    origin: str  # where it came from: "gguf", a file path, or "plain fallback"
    bos_token: str = ""
    eos_token: str = ""
    fallback_reason: str = ""  # why the model's own template is not used, if it is not

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Render in a forked child with a memory cap and a deadline where the OS allows, else in process.

        The sandbox stops attribute walks; no sandbox can see every way a filter or format string
        can build a huge value, so the child's address space is capped and it is killed when late.
        """
        msgs = [dict(m) for m in messages]
        if ISOLATE and hasattr(os, "fork"):
            return _render_forked(self, msgs, add_generation_prompt)
        return self.render_here(msgs, add_generation_prompt=add_generation_prompt)

    def render_here(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            template = env.from_string(self.source)
            with _time_limit(MAX_RENDER_SECONDS, self.origin):
                out = template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                )
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"chat template ({self.origin}) blocked by the sandbox: {e}") from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template ({self.origin}) failed: {e}") from None
        except (Exception, RecursionError) as e:  # untrusted code: any failure is the template's
            raise ChatTemplateError(f"chat template ({self.origin}) failed: {type(e).__name__}: {e}") from None
        if len(out) > MAX_OUTPUT_CHARS:
            raise ChatTemplateError(f"chat template ({self.origin}) produced {len(out)} characters; too large")
        return out


@contextlib.contextmanager
def _time_limit(seconds: float, origin: str) -> Iterator[None]:
    """Stop template code that runs past `seconds`.

    Jinja compiles a template to Python whose loops are Python loops: a trace function on this
    thread, active only in frames of that compiled code, checks the clock every 256 line events
    and raises into the template when time is up. Everything else runs untraced.
    """
    deadline = time.monotonic() + seconds
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        if count & 255 == 0 and time.monotonic() > deadline:
            raise ChatTemplateError(f"chat template ({origin}) ran longer than {seconds:g} s")
        return local

    def enter(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        yield
    finally:
        sys.settrace(previous)


SAMPLE_CONVERSATION = (
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Tell me a story."},
)


def load_chat_template(
    metadata: Mapping[str, Any],
    *,
    override: str | Path | None = None,
    bos_token: str = "",
    eos_token: str = "",
) -> ChatTemplate:
    """The template to use: `override` file > the GGUF's > the plain fallback (with a warning)."""
    if override is not None:
        path = Path(override)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"{path}: cannot read chat template: {e}") from None
        return ChatTemplate(source, str(path), bos_token, eos_token)
    embedded = metadata.get("tokenizer.chat_template")
    if isinstance(embedded, str) and embedded.strip():
        template = ChatTemplate(embedded, "gguf", bos_token, eos_token)
        try:
            template.render(SAMPLE_CONVERSATION)  # a template that cannot render a plain chat is not used
        except ChatTemplateError as e:
            logger.warning("%s; using a plain 'User:/Assistant:' format instead", e)
            return plain_template(bos_token, eos_token, reason=str(e))
        return template
    # Said where a chat is formatted with it (the app's info line, `run --chat`): a raw prompt needs none.
    logger.info("the model has no chat template: a chat uses a plain 'User:/Assistant:' format")
    return plain_template(bos_token, eos_token)


def plain_template(bos_token: str = "", eos_token: str = "", reason: str = "") -> ChatTemplate:
    return ChatTemplate(PLAIN_TEMPLATE, "plain fallback", bos_token, eos_token, reason)
