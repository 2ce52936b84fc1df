"""A decode token's MoE layer in one compiled call (kernels.moe_token, as the decode plan binds it) against
the general path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.generate import decode_one, prefill
from moechat.engine.loader import load_model
from moechat.engine.models.decode_plan import moe_token_call
from moechat.engine.models.decoder import MoeFFN
from moechat.engine.nn.layers import host_rows
from testkit.ggufgen import Q, tiny_moe


@pytest.mark.parametrize("kernels", ["int16", "int8"])
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "gpt-oss", "olmoe"])
def test_one_call_is_bit_identical_to_routing_then_the_experts(arch: str, kernels: str, tmp_path: Path) -> None:
    """Routing, gate/up, down and the sum in one call == select() then the host experts' three calls,
    bit for bit, for every MoE layer (biases and MXFP4 in gpt-oss, a shared expert in qwen2moe)."""
    qtype = Q.MXFP4 if arch == "gpt-oss" else Q.Q4_K
    lm = load_model(tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=qtype), n_ctx=32, cpu_kernels=kernels)
    experts = lm.model.host_experts
    ffns = [b.ffn for b in lm.model.blocks if isinstance(b.ffn, MoeFFN)]
    assert ffns
    torch.manual_seed(0)
    for ffn in ffns:
        call = moe_token_call(ffn, experts)
        assert call is not None
        for _ in range(4):
            h = torch.randn(1, lm.config.n_embd)
            one_ids, _, one = call(host_rows(h))
            ids, weights = ffn.select(h)
            assert torch.equal(torch.from_numpy(one_ids), ids)
            assert torch.equal(torch.from_numpy(one), experts(ffn.i, h, ids, weights))
    lm.close()


@pytest.mark.parametrize("kernels", ["int16", "int8"])
def test_a_step_of_tokens_in_one_call_is_each_token_alone(kernels: str, tmp_path: Path) -> None:
    """Several tokens in one call (a server's decode step: an expert's blocks read once for all the tokens routed to
    it) give each token the ids, weights and output it gets alone, bit for bit, with the norm and residual inside
    too: tokens that share all their experts (the same row twice), some, or none."""
    lm = load_model(tiny_moe(tmp_path / "m.gguf", expert_type=Q.Q4_K, n_expert=4), n_ctx=32, cpu_kernels=kernels)
    block = lm.model.blocks[0]
    torch.manual_seed(1)
    for norm in (None, block.ffn_norm):
        call = moe_token_call(block.ffn, lm.model.host_experts, norm, block.eps)
        assert call is not None
        rows = torch.randn(5, lm.config.n_embd)
        rows[3] = rows[1]  # the same experts as row 1
        ids, w, y = call(host_rows(rows))
        assert len({tuple(r) for r in ids.tolist()}) < 5  # (4 experts, 2 each: some rows share experts)
        for t in range(5):
            one_ids, one_w, one_y = call(host_rows(rows[t : t + 1]))
            assert (ids[t] == one_ids[0]).all() and (w[t] == one_w[0]).all() and (y[t] == one_y[0]).all()
    lm.close()


def test_grouped_routing_takes_the_general_path(tmp_path: Path) -> None:
    """DeepSeek's grouped choice with its choice bias has no compiled routing: the general path."""
    deepseek = load_model(tiny_moe(tmp_path / "ds.gguf", arch="deepseek2", expert_type=Q.Q8_0), n_ctx=32)
    ffn = next(b.ffn for b in deepseek.model.blocks if isinstance(b.ffn, MoeFFN))
    assert ffn.choice_bias is not None
    assert moe_token_call(ffn, deepseek.model.host_experts) is None
    deepseek.close()


def _decode(path: Path, settings: CacheSettings, per_token: bool, n: int = 24) -> tuple[list[int], Any, Any, int]:
    """Greedy tokens of a short decode with the cache, its token calls on or off; its stats and MIN window."""
    lm = load_model(path, n_ctx=64, cache=settings)
    cache = lm.cache
    assert cache is not None
    assert cache.per_token  # the settings allow it: switched off below for the general path
    cache.per_token = per_token
    lm.model.drop_plans()  # the plan binds the cache's token calls
    kv = lm.new_cache()
    tokens = [int(prefill(lm.model, [1, 5, 9, 2, 7], kv).argmax())]
    for _ in range(n):
        tokens.append(int(decode_one(lm.model, tokens[-1], kv).argmax()))
    snap, window, count = cache.snapshot(), cache.log.window(), cache.tokens
    lm.close()
    return tokens, snap.layers, window, count


@pytest.mark.parametrize(("policy", "share", "link"), [("classlru", 0.5, 0.0), ("classlru", 0.0, 50.0),
                                                        ("second-use", 0.5, 0.0), ("upload-cap", 0.0, 0.0),
                                                        ("protect", 0.0, 0.0)])  # fmt: skip
def test_the_cache_on_token_calls_counts_what_its_general_path_counts(
    policy: str, share: float, link: float, tmp_path: Path
) -> None:
    """With slots that are the host copy, a decode token runs the one-call kernels and tells the cache its
    lookups afterwards (`ExpertCache.account`): the same tokens, every counter, the slots, the use counts
    and the MIN window's lookups as when each layer's lookup goes through the cache first."""
    path = tiny_moe(tmp_path / "m.gguf", n_expert=16)
    settings = CacheSettings(mib=1.6, cpu_share=share, policy=policy, emulate_link_gbps=link)
    fast, general = _decode(path, settings, True), _decode(path, settings, False)
    assert fast[0] == general[0]
    assert fast[1] == general[1]  # per layer: counters, the cached experts, each expert's uses
    assert sum(layer.small.uploads for layer in fast[1]) > 0  # the cache was small enough to miss
    assert fast[2] == general[2]
    assert fast[3] == general[3] > 20


def test_a_prefetching_cache_keeps_its_token_calls_and_counts_what_its_general_path_counts(tmp_path: Path) -> None:
    """Look-ahead with slots that are the host copy: the token calls stay, and the predictions they tell the cache
    with their lookups (`TokenAhead`) land as the general path's `prefetch` calls land: the same tokens, the same
    trace (each prediction before its layer's lookup) and the same counters, prefetches and recall included."""
    from moechat.engine.cache.trace import read_trace

    path = tiny_moe(tmp_path / "q.gguf", n_expert=16)
    runs = {}
    for per_token in (True, False):
        trace = tmp_path / f"{per_token}.trace"
        settings = CacheSettings(mib=1.6, prefetch="next-layer", trace=trace, cpu_share=0.5)
        tokens, layers, _, count = _decode(path, settings, per_token)
        records = [(r.layer, r.n_used, tuple(r.ids)) for r in read_trace(trace).records]
        runs[per_token] = (tokens, [(la.layer, la.small, la.large) for la in layers], records, count)
    assert runs[True] == runs[False]
    records = runs[True][2]
    assert any(layer < 0 for layer, _, _ in records)  # predictions were recorded, before their lookups
    total = sum((small + large for _, small, large in runs[True][1]), start=type(runs[True][1][0][1])())
    assert total.prefetched > 0 and 0 < total.predicted_used <= total.predicted


def test_a_traced_cache_keeps_its_token_calls_and_writes_the_same_trace(tmp_path: Path) -> None:
    """A trace records the lookups, it does not act on them: the token calls stay (the general path cost
    the tuner's cached runs a quarter of their speed against its run without a cache), and `account`
    writes the records the general path writes, in the same order."""
    from moechat.engine.cache.trace import read_trace

    path = tiny_moe(tmp_path / "m.gguf", n_expert=16)
    runs = {}
    for per_token in (True, False):
        trace = tmp_path / f"{per_token}.trace"
        _decode(path, CacheSettings(mib=1.6, cpu_share=0.5, trace=trace), per_token)
        runs[per_token] = [(r.layer, r.n_used, tuple(r.ids)) for r in read_trace(trace).records]
    assert runs[True] == runs[False] and len(runs[True]) > 24
