"""A decode token's MoE layer in one compiled call (kernels.moe_token) against the general path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.loader import load_model
from moechat.engine.models.decoder import MoeFFN
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
        for _ in range(4):
            h = torch.randn(1, lm.config.n_embd)
            one = ffn.routed_token(h, experts)
            assert one is not None
            ids, weights = ffn.select(h)
            assert torch.equal(ffn.last_ids, ids)  # the routing it records for the stats
            assert torch.equal(one, experts(ffn.i, h, ids, weights))
        assert ffn.routed_token(torch.randn(2, lm.config.n_embd), experts) is None  # a token at a time only
    lm.close()


def test_a_cache_or_grouped_routing_takes_the_general_path(tmp_path: Path) -> None:
    """A layer behind the expert cache goes through the cache; DeepSeek's grouped choice with its
    choice bias has no compiled routing: both take the general path."""
    deepseek = load_model(tiny_moe(tmp_path / "ds.gguf", arch="deepseek2", expert_type=Q.Q8_0), n_ctx=32)
    ffn = next(b.ffn for b in deepseek.model.blocks if isinstance(b.ffn, MoeFFN))
    assert ffn.choice_bias is not None
    assert ffn.routed_token(torch.randn(1, deepseek.config.n_embd), deepseek.model.host_experts) is None
    deepseek.close()
    cached = load_model(tiny_moe(tmp_path / "q.gguf"), n_ctx=32, cache=CacheSettings(mib=0.5, cpu_share=0.5))
    ffn = next(b.ffn for b in cached.model.blocks if isinstance(b.ffn, MoeFFN))
    h = torch.randn(1, cached.config.n_embd)
    assert ffn.routed_token(h, cached.model.experts) is None
    assert ffn.routed_token(h, cached.model.host_experts) is not None  # the same layer without the cache
    cached.close()
