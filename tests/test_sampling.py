"""Sampling and the generation event stream."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from moechat.engine.events import DoneEvent, SamplingParams, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import load_model
from moechat.engine.sampling import BLOCK, sample, top_ids
from testkit.ggufgen import tiny_moe


def _draws(logits: torch.Tensor, p: SamplingParams, n: int = 400, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [sample(logits, p, [], gen) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert set(_draws(logits, SamplingParams(temperature=0), n=5)) == {1}


def test_seed_reproducible_and_different_seeds_differ() -> None:
    logits = torch.zeros(50)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    assert _draws(logits, p, seed=3) == _draws(logits, p, seed=3)
    assert _draws(logits, p, seed=3) != _draws(logits, p, seed=4)
    assert len(set(_draws(logits, p))) > 40  # really samples


def test_top_k_min_p_top_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    assert set(_draws(logits, SamplingParams(**{**base, "top_k": 1}))) == {0}
    assert set(_draws(logits, SamplingParams(**{**base, "top_k": 2}))) == {0, 1}
    assert set(_draws(logits, SamplingParams(**{**base, "min_p": 0.2}))) == {0, 1, 2}  # 0.05 < 0.2*0.5
    assert set(_draws(logits, SamplingParams(**{**base, "top_p": 0.7}))) == {0, 1}
    assert set(_draws(logits, SamplingParams(**base))) == {0, 1, 2, 3}


@pytest.mark.parametrize("n", [7, BLOCK * 3, BLOCK * 40 + 17, 151936])
@pytest.mark.parametrize("k", [1, 5, 40, 200])
def test_top_ids_are_a_stable_sorts_first_k(n: int, k: int) -> None:
    """Ties (integer logits) go to the lower id, as a stable sort orders them; sizes off the block grid too."""
    rng = np.random.default_rng(n * 1000 + k)
    for x in (rng.standard_normal(n).astype(np.float32), rng.integers(-5, 5, n).astype(np.float32)):
        want = np.argsort(-x, kind="stable")[:k]
        np.testing.assert_array_equal(top_ids(x, k), want)
    np.testing.assert_array_equal(top_ids(x, 0), np.argsort(-x, kind="stable"))


def _reference(logits: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """Each id's probability under the parameters, over the whole vocabulary (float64)."""
    x = logits.double() / p.temperature
    keep = torch.zeros_like(x, dtype=torch.bool)
    order = torch.argsort(x, descending=True, stable=True)
    keep[order[: p.top_k if p.top_k > 0 else x.numel()]] = True
    probs = torch.where(keep, torch.softmax(torch.where(keep, x, -torch.inf), 0), 0)
    probs[probs < p.min_p * probs.max()] = 0
    sorted_p = probs[order]
    drop = sorted_p.cumsum(0) - sorted_p > p.top_p
    probs[order[drop]] = 0
    return (probs / probs.sum()).numpy()


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(),
        SamplingParams(temperature=1.3, top_k=0, top_p=0.9, min_p=0.0),
        SamplingParams(temperature=0.5, top_k=12, top_p=1.0, min_p=0.1),
    ],
)
def test_draws_follow_the_whole_vocabulary_distribution(p: SamplingParams) -> None:
    """Drawing among the top-k candidates gives the distribution the whole-vocabulary arithmetic defines:
    the same support, and frequencies within five standard errors of each probability."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3000, generator=gen) * 2.5
    want = _reference(logits, p)
    n = 6000
    draws = np.array(_draws(logits, p, n=n, seed=2))
    got = np.bincount(draws, minlength=want.shape[0]) / n
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want))
    assert np.all(np.abs(got - want) <= 5 * np.sqrt(want * (1 - want) / n) + 1e-9)
    assert len(set(draws.tolist())) > 3  # really samples


def test_repeat_penalty_moves_greedy_off_a_repeated_token() -> None:
    logits = torch.tensor([2.0, 1.5, 0.0])
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(temperature=0), [0], gen) == 0
    assert sample(logits, SamplingParams(temperature=0, repeat_penalty=1.5), [0], gen) == 1


@pytest.mark.parametrize(
    ("kw", "msg"), [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top-p"), ({"min_p": 1.0}, "min-p")]
)
def test_bad_parameters(kw: dict[str, float], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw).validate()


def test_stop_request_is_honoured_between_tokens(tmp_path: Path) -> None:
    lm = load_model(tiny_moe(tmp_path / "m.gguf", n_vocab=300), n_ctx=128)
    prompt = lm.tokenizer.encode("Hello")
    stop = threading.Event()
    got = []
    for ev in generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=50, ignore_eos=True, stop=stop):
        got.append(ev)
        if isinstance(ev, TokenEvent) and ev.index == 2:
            stop.set()
    done = got[-1]
    assert isinstance(done, DoneEvent) and done.stop_reason == "stopped" and done.n_generated == 3
    # The context bound ends generation cleanly, too.
    cache = lm.new_cache()
    cache.n_ctx = len(prompt) + 4
    events = list(generate(lm.model, lm.tokenizer, prompt, cache, max_tokens=50, ignore_eos=True))
    end = events[-1]
    assert isinstance(end, DoneEvent) and end.stop_reason == "context" and end.n_generated == 5


def test_token_events_carry_timing_and_routing_is_read_on_demand(tmp_path: Path) -> None:
    """Events carry no routing (nothing per layer per token crosses to the host for them); the model
    gives its latest step's routing when asked."""
    lm = load_model(tiny_moe(tmp_path / "m.gguf", n_vocab=300), n_ctx=64)
    routings = []
    events = []
    for e in generate(lm.model, lm.tokenizer, lm.tokenizer.encode("Hi"), lm.new_cache(), max_tokens=5, ignore_eos=True):
        if isinstance(e, TokenEvent) and e.token >= 0:
            events.append(e)
            routings.append(lm.model.routing())
    assert len(events) == 5 and not hasattr(events[0], "routing")
    for ev, routing in zip(events, routings, strict=True):
        assert ev.seconds > 0
        assert len(routing) == lm.config.n_layers
        assert all(len(r) == lm.config.n_expert_used and len(set(r)) == len(r) for r in routing)
        assert all(0 <= e < lm.config.n_expert for r in routing for e in r)
    assert len(set(routings)) > 1  # routing changes with the token
