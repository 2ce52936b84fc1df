"""GGUF chat templates are untrusted code: injection attempts and denial of service fail safely and fast."""

from __future__ import annotations

import time

import pytest
from moechat.engine.text.chat_template import MAX_RENDER_SECONDS, ChatTemplate, ChatTemplateError, load_chat_template
from testkit.timing import baseline_seconds

MESSAGES = [{"role": "user", "content": "hi"}]

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ().__class__.__base__.__subclasses__()[0] }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__['__builtins__'] }}",
    "{{ lipsum.__globals__['os'].system('true') }}",
    "{{ self.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['sys'].modules }}",
    "{{ messages.__class__.__mro__ }}",
    "{{ messages[0].__class__.__init__.__globals__ }}",
    "{{ messages|attr('__class__')|attr('__mro__') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ messages.append(1) }}{{ messages }}",
    "{% set x = messages.pop() %}{{ x }}",
    "{{ (messages[0]).update({'role': 'system'}) }}",
    "{{ config.items() }}{{ request.environ }}",
    "{{ range.__self__ }}",
    "{% for c in ''.__class__.__mro__[-1].__subclasses__() %}{{ c }}{% endfor %}",
]

DENIALS = [
    "{{ 'a' * 10**9 }}",
    "{{ 'a' * 100000 * 100000 }}",
    "{{ [1] * 10**9 }}",
    "{{ 2 ** (10 ** 9) }}",
    "{% for i in range(10**9) %}x{% endfor %}",
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{% for a in range(90000) %}{% for b in range(90000) %}{{ '' }}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% set s = 'x' * 900000 %}{% for i in range(50) %}{{ s }}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{{ range(100000) | join('x' * 999999) }}",
    "{{ '{:>1000000000}'.format(1) }}",
    "{{ 'x' | center(1000000000) }}",
    "{{ ('x' * 999999) | replace('x', 'y' * 999999) }}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% if i == j %}{% endif %}{% endfor %}{% endfor %}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_escapes_raise_or_leak_nothing(source: str) -> None:
    """The sandbox either refuses an attribute walk or turns it into an empty undefined value."""
    try:
        out = ChatTemplate(source, "gguf").render(MESSAGES)
    except ChatTemplateError as e:
        assert "\n" not in str(e)
        return
    for leak in ("<class", "<module", "<function", "<built-in", "__", "environ", "uid="):
        assert leak not in out, out[:200]
    assert MESSAGES == [{"role": "user", "content": "hi"}]  # nothing was mutated


@pytest.mark.slow
@pytest.mark.parametrize("source", [e for e in ESCAPES if "subclasses()" in e or ".read()" in e] + DENIALS)
def test_hostile_templates_fail_safely_and_fall_back(source: str) -> None:
    slack = 300 * baseline_seconds()  # the limit's own overshoot and the fallback's work, on this machine
    t = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source, "gguf").render(MESSAGES)
    assert time.monotonic() - t < MAX_RENDER_SECONDS + slack, "the render bound did not hold"
    assert "\n" not in str(info.value)
    # Loading a model with this template: a warning and the plain format, with the reason kept.
    t = time.monotonic()
    template = load_chat_template({"tokenizer.chat_template": source})
    assert template.origin == "plain fallback" and template.fallback_reason
    assert "User: hi" in template.render(MESSAGES)
    assert time.monotonic() - t < MAX_RENDER_SECONDS + slack


def test_real_templates_still_render() -> None:
    qwen = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    t = load_chat_template({"tokenizer.chat_template": qwen})
    assert t.origin == "gguf" and not t.fallback_reason
    assert t.render(MESSAGES).endswith("<|im_start|>assistant\n")
    # A big but honest conversation renders quickly under the time limit.
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 50} for i in range(400)]
    unit = baseline_seconds()

    def best_of_three(messages: list[dict[str, str]], turns: int) -> float:
        # the best of three: one stall of a shared machine (60 units once) is not the render's
        took = []
        for _ in range(3):
            start = time.monotonic()
            assert t.render(messages).count("<|im_start|>") == turns + 1
            took.append(time.monotonic() - start)
        return min(took)

    # A render forks a child. Late in a whole-suite run this render took 0.58-0.64 s in all three tries,
    # not here; the likely cost is the fork of the grown process, which every render pays, so the
    # bound is on what the big conversation adds to a small one's render in the same process.
    small = best_of_three(list(MESSAGES), len(MESSAGES))
    assert best_of_three(many, 400) - small < 50 * unit  # about 1.5 units here


def test_a_template_that_fails_later_switches_the_session_to_plain(tmp_path: object) -> None:
    """Fine on the sample chat, refusing a real one: the engine falls back and says why."""
    from pathlib import Path

    from moechat.app.real_engine import RealEngine
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.loader import load_model
    from testkit.ggufgen import tiny_moe

    picky = "{% for m in messages %}{% if 'boom' in m['content'] %}{{ raise_exception('no') }}{% endif %}" \
            "{{ m['content'] }}{% endfor %}"  # fmt: skip
    path = tiny_moe(Path(str(tmp_path)) / "m.gguf", template=picky)
    engine = RealEngine(load_model(path, n_ctx=128), CacheSettings())
    assert engine.info.template == "gguf"
    _, _, note = engine.fit_messages([{"role": "user", "content": "hello"}])
    assert note == ""
    tokens, _, note = engine.fit_messages([{"role": "user", "content": "boom"}])
    assert tokens and "refused" in note and engine.lm.template.origin == "plain fallback"
    engine.close()
