"""Chat templates render in a sandbox: real templates work, hostile ones fail without running."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from moechat.engine.gguf.reader import GGUFFile
from moechat.engine.text.chat_template import PLAIN_TEMPLATE, ChatTemplate, ChatTemplateError, load_chat_template

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


def test_template_from_the_gguf(tiny_model: Path) -> None:
    with GGUFFile(tiny_model) as f:
        t = load_chat_template(f.metadata)
    assert t.origin == "gguf"
    out = t.render(CHAT)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not t.render(CHAT, add_generation_prompt=False).endswith("assistant\n")


def test_override_file_wins(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}\n{% endfor %}")
    with GGUFFile(tiny_model) as f:
        t = load_chat_template(f.metadata, override=path, bos_token="<s>")
    assert t.origin == str(path)
    assert t.render(CHAT[:2]) == "<s>[system] BE BRIEF.\n[user] HI\n"
    with pytest.raises(ChatTemplateError, match="cannot read chat template"):
        load_chat_template({}, override=tmp_path / "missing.jinja")


def test_no_template_falls_back_and_warns_only_where_a_chat_uses_it(caplog: pytest.LogCaptureFixture) -> None:
    """A raw prompt (`run --raw`, a base model's default) needs no template: the load says it at info level;
    the app's info line and `run --chat` say it where a chat is formatted."""
    with caplog.at_level(logging.INFO):
        t = load_chat_template({"general.architecture": "gemma3"})
    assert t.source == PLAIN_TEMPLATE and t.origin == "plain fallback"
    assert "no chat template" in caplog.text
    assert all(r.levelno < logging.WARNING for r in caplog.records)
    assert t.render(CHAT[1:2]) == "User: Hi\nAssistant:"


def test_tojson_and_raise_exception() -> None:
    t = load_chat_template({"tokenizer.chat_template": "{{ messages | tojson }}"})
    assert t.render([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]'
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}", "gguf")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render(CHAT)


HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ joiner.__init__.__globals__['os'].system('touch {marker}') }}",
    "{{ self.__init__.__globals__.__builtins__.open('{marker}', 'w') }}",
    "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('touch {marker}') }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ lipsum.__globals__['os'].system('touch {marker}') }}",
    "{% set x = messages.append({{'role': 'user'}}) %}",
    "{{ 'a' * 100000000 }}",
    "{{ ['x'] * 10000000 }}",
    "{{ 10 ** 1000000 }}",
    "{% for i in range(100000000) %}x{% endfor %}",
    "{% for m in messages %}",
]


@pytest.mark.parametrize("source", HOSTILE)
def test_hostile_templates_fail_safely(source: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    source = source.replace("{marker}", str(marker))
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source, "gguf").render(CHAT)
    assert "\n" not in str(e.value).strip()
    t = load_chat_template({"tokenizer.chat_template": source})  # a model carrying it: the plain format instead
    assert t.origin == "plain fallback" and t.fallback_reason
    assert not marker.exists()
    assert len(CHAT) == 4  # the template could not mutate our messages
