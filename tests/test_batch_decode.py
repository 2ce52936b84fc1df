"""Many sequences decoded together (engine.serving, `DecoderBase.step`): each sequence's logits are those it gets
alone, bit for bit, on every family's layers; the batcher's slots keep conversations apart and hand a cancelled
request's slot on at once."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.events import GREEDY, DoneEvent, Event, TokenEvent
from moechat.engine.generate import decode_one, one_torch_thread, prefill
from moechat.engine.loader import load_model
from moechat.engine.nn.layers import KVBank
from moechat.engine.serving.batcher import Ask, Batcher
from moechat.engine.serving.slots import Slots
from testkit.ggufgen import Q, tiny_moe

PROMPTS = [[1, 5, 9, 2, 7, 3, 3, 3, 3, 11], [3, 4], [8, 8, 8, 1, 2, 3, 4], [20, 21, 22]]


def _alone(lm: Any, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """The logits of `steps` greedy decode tokens after `prompt`, one sequence by itself (the decode plan)."""
    kv = lm.new_cache()
    tok, out = int(prefill(lm.model, prompt, kv).argmax()), []
    for _ in range(steps):
        logits = decode_one(lm.model, tok, kv)
        out.append(logits)
        tok = int(logits.argmax())
    return out


@pytest.mark.parametrize(
    ("arch", "kw"),
    [
        ("qwen3moe", {"expert_type": Q.Q4_K, "dense_type": Q.Q4_K}),  # every layer two compiled calls
        ("qwen2moe", {"expert_type": Q.Q8_0, "dense_type": Q.Q8_0}),  # a shared expert beside the routed call
        ("gpt-oss", {"expert_type": Q.MXFP4, "dense_type": Q.Q8_0}),  # sinks, biases, sliding windows
        ("qwen3moe", {"expert_type": Q.Q4_K, "dense_type": Q.Q4_K, "n_expert": 0}),  # a dense model
        ("deepseek2", {"expert_type": Q.Q8_0, "dense_type": Q.Q8_0}),  # latent attention, grouped routing
        ("qwen3next", {"expert_type": Q.Q8_0, "dense_type": Q.Q8_0}),  # linear attention's per-slot state
    ],
    ids=["qwen3moe", "qwen2moe", "gpt-oss", "dense", "deepseek2", "qwen3next"],
)
def test_a_step_gives_each_sequence_the_logits_it_gets_alone(arch: str, kw: dict[str, Any], tmp_path: Path) -> None:
    lm = load_model(tiny_moe(tmp_path / "m.gguf", arch=arch, **kw), n_ctx=64)
    prompts = PROMPTS[:3]
    alone = [_alone(lm, p, 3) for p in prompts]
    caches = KVBank(lm.config, 64, 3).caches()
    with torch.inference_mode(), one_torch_thread(True):
        tokens = [int(prefill(lm.model, p, c).argmax()) for p, c in zip(prompts, caches, strict=True)]
        for step in range(3):
            logits = lm.model.step(tokens, caches)
            for t in range(3):
                assert torch.equal(logits[t], alone[t][step]), (step, t)
            tokens = [int(row.argmax()) for row in logits]
    assert [c.pos for c in caches] == [len(p) + 3 for p in prompts]
    lm.close()


def test_a_step_behind_the_expert_cache_is_each_token_alone_and_counts_every_token(tmp_path: Path) -> None:
    """With the expert cache on (slots that are the host copy, a CPU share), a step of three tokens computes what
    each computes alone, and the cache counts all three tokens' lookups."""
    lm = load_model(tiny_moe(tmp_path / "m.gguf", expert_type=Q.Q4_K, dense_type=Q.Q4_K), n_ctx=64,
                    cache=CacheSettings(mib=0.5, cpu_share=0.5))  # fmt: skip
    assert lm.cache is not None
    prompts = PROMPTS[:3]
    alone = [_alone(lm, p, 2) for p in prompts]
    caches = KVBank(lm.config, 64, 3).caches()
    with torch.inference_mode():
        tokens = [int(prefill(lm.model, p, c).argmax()) for p, c in zip(prompts, caches, strict=True)]
        before = lm.cache.tokens
        for step in range(2):
            logits = lm.model.step(tokens, caches)
            assert all(torch.equal(logits[t], alone[t][step]) for t in range(3))
            tokens = [int(row.argmax()) for row in logits]
    assert lm.cache.tokens == before + 6
    lm.close()


def _rss_bytes() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text())[1]) * 1024  # type: ignore[index]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
def test_a_bank_takes_memory_as_its_slots_are_written(tmp_path: Path) -> None:
    """Four slots of a long context cost next to nothing until written: a server's --parallel does not take every
    slot's whole context at start. Written positions read back (the pages are real)."""
    lm = load_model(tiny_moe(tmp_path / "m.gguf"), n_ctx=64)
    with torch.inference_mode():
        prefill(lm.model, PROMPTS[0], lm.new_cache())  # (a prompt's own buffers and kernels, once)
    before = _rss_bytes()
    bank = KVBank(lm.config, 1 << 15, 4)
    size = sum(t.numel() * t.element_size() for t in [*bank.k, *bank.v] if t is not None)
    assert size >= 128 << 20
    assert _rss_bytes() - before < size // 16
    caches = bank.caches()
    with torch.inference_mode():
        prefill(lm.model, PROMPTS[0], caches[2])
    # A written position takes its page (2 MiB where the kernel backs memory with huge pages) in each layer's
    # KV heads: far below the bank.
    assert _rss_bytes() - before < size // 4
    assert float(caches[2].layers[0].k[: len(PROMPTS[0])].abs().sum()) > 0 and float(bank.k[0][1].abs().sum()) == 0
    lm.close()


class Served:
    """A batcher's requests run to their end: each one's tokens and DoneEvent."""

    def __init__(self, lm: Any, n_slots: int, chunk: int = 4) -> None:
        self.batcher = Batcher(lm.model, lm.tokenizer, Slots(KVBank(lm.config, 96, n_slots), can_roll_back=True),
                               chunk=chunk)  # fmt: skip
        self.tokens: dict[int, list[int]] = {}
        self.done: dict[int, DoneEvent] = {}

    def submit(self, i: int, prompt: list[int], n: int = 10) -> Any:
        self.tokens[i] = []

        def emit(ev: Event) -> None:
            if isinstance(ev, TokenEvent) and ev.token >= 0:
                self.tokens[i].append(ev.token)
            elif isinstance(ev, DoneEvent):
                self.done[i] = ev

        return self.batcher.submit(Ask(prompt, GREEDY, n, ignore_eos=True), emit)

    def run(self) -> None:
        while self.batcher.busy:
            self.batcher.step()


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = load_model(tiny_moe(tmp_path_factory.mktemp("b") / "m.gguf", expert_type=Q.Q4_K, dense_type=Q.Q4_K),
                       n_ctx=96)  # fmt: skip
    yield model
    model.close()


def test_requests_served_together_write_what_each_writes_alone(lm: Any) -> None:
    """Four requests on four slots (prompts read a chunk a step while the others decode), and on two (two wait for
    a slot): each one's tokens are those it gets on a server of its own; the steps ran several tokens at once."""
    alone = {}
    for i, p in enumerate(PROMPTS):
        one = Served(lm, 1)
        one.submit(i, p)
        one.run()
        alone[i] = one.tokens[i]
        assert one.done[i].stop_reason == "length" and one.done[i].n_generated == 10
    for n_slots in (4, 2):
        many = Served(lm, n_slots)
        for i, p in enumerate(PROMPTS):
            many.submit(i, p)
        many.batcher.step()
        status = many.batcher.status()
        assert (status.active, status.queued) == (n_slots, 4 - n_slots)
        many.run()
        assert many.tokens == alone
        assert many.batcher.steps < 4 * 10  # (the tokens went through together)
        assert many.batcher.status().active == 0


def test_conversations_served_in_turn_each_find_their_prefix_again(lm: Any) -> None:
    """Two conversations alternating on two slots: each turn reads only what its conversation appended, and the
    same prompt asked again starts from the logits kept after it (nothing read, the same reply)."""
    s = Served(lm, 2)
    a = [1, 5, 9, 2, 7, 3, 3, 3]
    b = [40, 41, 42, 43, 44, 45]
    for i, p in enumerate((a, b)):
        s.submit(i, p, 4)
    s.run()
    a2 = [*a, *s.tokens[0], 60, 61]
    b2 = [*b, *s.tokens[1], 70]
    s.submit(2, a2, 4)
    s.submit(3, b2, 4)
    s.run()
    assert s.done[2].n_kept == len(a) + 3 and s.done[2].n_prompt == len(a2) - s.done[2].n_kept
    assert s.done[3].n_kept == len(b) + 3
    s.submit(4, a2, 4)
    s.run()
    assert s.done[4].n_kept == len(a2) and s.done[4].n_prompt == 0
    assert s.tokens[4] == s.tokens[2]


def test_a_cancelled_request_hands_its_slot_on_at_once(lm: Any) -> None:
    """On one slot: a request cancelled mid-reply ends "stopped" at its next token, and the one waiting behind it
    starts in the same step; one cancelled while it waits never takes the slot."""
    s = Served(lm, 1)
    first = s.submit(0, PROMPTS[0], 50)
    s.submit(1, PROMPTS[1], 3)
    third = s.submit(2, PROMPTS[2], 3)
    third.cancel()
    while len(s.tokens[0]) < 2:
        s.batcher.step()
    first.cancel()
    s.batcher.step()
    assert s.done[0].stop_reason == "stopped" and len(s.tokens[0]) == 2
    assert s.batcher.status().active == 1  # the second request took the slot
    s.run()
    assert s.done[1].stop_reason == "length" and len(s.tokens[1]) == 3
    assert s.done[2].stop_reason == "stopped" and s.tokens[2] == []
