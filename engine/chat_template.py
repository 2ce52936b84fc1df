"""Chat templates: Jinja from the GGUF (`tokenizer.chat_template`), rendered in a sandbox.

A template inside a downloaded model file is untrusted code. It runs in Jinja's
`ImmutableSandboxedEnvironment` (no attribute walks to `__class__`, `__globals__` and the
like, no mutation of our objects), with bounds on string sizes it may build and on the size
of what it returns. Any failure becomes a `ChatTemplateError` with one clear line.
"""

from __future__ import annotations

import json
import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

logger = logging.getLogger(__name__)

MAX_OUTPUT_CHARS = 4_000_000
MAX_STRING_CHARS = 1_000_000

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

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            template = env.from_string(self.source)
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
        return ChatTemplate(embedded, "gguf", bos_token, eos_token)
    logger.warning("the model has no chat template: using a plain 'User:/Assistant:' format")
    return ChatTemplate(PLAIN_TEMPLATE, "plain fallback", bos_token, eos_token)
