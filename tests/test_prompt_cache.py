"""The conversation's KV cache is kept across replies: a turn reads only what it appended, a
regenerated or edited turn rolls back to the longest common prefix, and what the model computes
after a resumed prompt is what it computes after reading the whole prompt."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from moechat.app.real_engine import RealEngine
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.events import GREEDY, DoneEvent, SamplingParams, TokenEvent
from moechat.engine.generate import prefill
from moechat.engine.loader import LoadedModel, load_model
from moechat.engine.prompt_cache import PromptCache, common_prefix
from testkit.ggufgen import tiny_moe


def _reply(engine: RealEngine, chat: list[dict[str, str]], params: SamplingParams = GREEDY) -> tuple[str, DoneEvent]:
    prompt, _, _ = engine.fit_messages(chat)
    events = list(engine.reply(prompt, params, 12, threading.Event()))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return "".join(e.text for e in events if isinstance(e, TokenEvent)), done


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("m") / "m.gguf")


def _engine(path: Path) -> RealEngine:
    return RealEngine(load_model(path, n_ctx=512, cache=CacheSettings(mib=1.0, cpu_share=0.5)), CacheSettings())


def test_each_turn_reads_only_what_it_appended(model: Path) -> None:
    engine = _engine(model)
    chat = [{"role": "system", "content": "Be brief."}]
    held: list[int] = []
    for turn, question in enumerate(["Hello there", "What is the sea?", "And the sky?", "Thanks, bye"]):
        chat.append({"role": "user", "content": question})
        prompt, _, _ = engine.fit_messages(chat)
        expected_new = len(prompt) - min(common_prefix(held, prompt), len(prompt) - 1)
        text, done = _reply(engine, chat)
        assert done.n_prompt == expected_new
        if turn == 0:
            assert done.n_prompt == len(prompt)  # the first turn reads it all
        else:
            assert done.n_prompt < len(prompt) // 2, (turn, done.n_prompt, len(prompt))  # the new turn only
        held = engine.prompts.tokens
        chat.append({"role": "assistant", "content": text})
    engine.close()


def test_regenerate_and_edit_roll_back_to_the_common_prefix(model: Path) -> None:
    engine = _engine(model)
    chat = [{"role": "user", "content": "Tell me about rivers"}]
    first, done = _reply(engine, chat)
    prompt, _, _ = engine.fit_messages(chat)
    assert done.n_prompt == len(prompt)
    again, done = _reply(engine, chat)  # regenerate: the same prompt
    assert done.n_prompt == 0 and again == first  # nothing is read again: the logits after it were kept
    edited = [{"role": "user", "content": "Tell me about lakes"}]
    new_prompt, _, _ = engine.fit_messages(edited)
    _, done = _reply(engine, edited)
    assert done.n_prompt == len(new_prompt) - common_prefix(prompt, new_prompt)
    assert 0 < done.n_prompt < len(new_prompt)
    engine.close()


def _logits_after(lm: LoadedModel, cache: PromptCache, prompt: list[int]) -> torch.Tensor:
    kv, held, kept = cache.resume(prompt)
    logits = prefill(lm.model, prompt[held:], kv) if kept is None else kept
    cache.record(prompt, (len(prompt), logits))
    return logits


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_a_resumed_prompt_computes_what_a_whole_one_does(arch: str, tmp_path: Path) -> None:
    """Kept, rolled back or (recurrent layers) started over: the logits after the prompt are the
    logits after reading it whole."""
    # int16 everywhere: a resumed prompt's few new tokens take decode's width, which by default may
    # be int8 (kernels.isa.activation_bits), and this test's bound is the bookkeeping's, not int8's.
    lm = load_model(tiny_moe(tmp_path / "m.gguf", arch=arch), n_ctx=256, cpu_kernels="int16")
    recurrent = arch == "qwen3next"
    kept = PromptCache(lm.new_cache, can_roll_back=not recurrent)
    base = lm.tokenizer.encode("The ferry crossed the river twice a day, and the children")
    longer = base + lm.tokenizer.encode(" on the bank counted the boats")
    other = base[:5] + lm.tokenizer.encode(" stone bridge")
    for prompt in (base, longer, other):
        ours = _logits_after(lm, kept, prompt)
        whole = prefill(lm.model, prompt, lm.new_cache())
        assert float((ours - whole).abs().max() / whole.abs().max()) <= 1e-4
    # What was read again: after `longer`, `other` keeps its first 5 tokens, or nothing where the
    # layers cannot roll back.
    assert kept.kv is not None and kept.kv.pos == len(other)
    _, held, _ = kept.resume(other[:5] + lm.tokenizer.encode(" road"))
    assert held == (0 if recurrent else 5)
    lm.close()


def test_resume_reads_the_last_token_again_and_starts_over_when_nothing_is_shared() -> None:
    made = []

    class FakeKV:
        pos = 0

    def make() -> FakeKV:
        made.append(FakeKV())
        return made[-1]

    cache = PromptCache(make, can_roll_back=True)
    kv, held, kept = cache.resume([1, 2, 3])
    assert held == 0 and kept is None and len(made) == 1
    kv.pos = 5
    cache.record([1, 2, 3, 4, 5, 6])  # 6 was sampled, never read
    assert cache.tokens == [1, 2, 3, 4, 5]
    kv, held, kept = cache.resume([1, 2, 3, 4, 5])  # the same prompt, no logits kept: its last token is read again
    assert held == 4 and kv.pos == 4 and kept is None and len(made) == 1
    kv, held, kept = cache.resume([9, 9])
    assert held == 0 and len(made) == 2  # nothing shared: a fresh cache


def test_the_same_prompt_again_starts_from_the_kept_logits_and_reads_nothing() -> None:
    class FakeKV:
        pos = 0

    cache = PromptCache(FakeKV, can_roll_back=True)
    kv, _, _ = cache.resume([1, 2, 3])
    kv.pos = 5  # the prompt and two of the reply's tokens read
    after = torch.arange(4.0)
    cache.record([1, 2, 3, 7, 8, 9], (3, after))
    kv, held, kept = cache.resume([1, 2, 3])
    assert held == 3 and kv.pos == 3 and kept is not None and torch.equal(kept, after)
    kv, held, kept = cache.resume([1, 2, 3, 4])  # a longer prompt: read from where they part
    assert held == 3 and kept is None
    kv, held, kept = cache.resume([1, 2])  # rolled back before the kept logits: they are gone
    assert held == 1 and kept is None
    kv.pos = 3
    cache.record([1, 2, 3])
    assert cache.resume([1, 2, 3])[2] is None

    recurrent = PromptCache(FakeKV, can_roll_back=False)  # cannot go back to the prompt's end
    kv, _, _ = recurrent.resume([1, 2, 3])
    kv.pos = 5
    recurrent.record([1, 2, 3, 7, 8, 9], (3, after))
    kv, held, kept = recurrent.resume([1, 2, 3])
    assert held == 0 and kept is None
