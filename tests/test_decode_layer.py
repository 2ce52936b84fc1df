"""A decode token's layer in two compiled calls (models.decoder.Block.decode_layer) against the per-part path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.generate import decode_one, prefill
from moechat.engine.loader import load_model
from moechat.engine.models.decoder import Block, MoeFFN
from moechat.engine.nn.layers import KVCache
from moechat.engine.nn.qlinear import set_activation_bits
from testkit.ggufgen import Q, tiny_moe


def _steps(lm: object, whole: bool, n: int = 5) -> tuple[list[torch.Tensor], list[tuple[tuple[int, ...], ...]]]:
    """n greedy decode steps after a short prompt, with or without the two-call layers: logits and routing."""
    model = lm.model  # type: ignore[attr-defined]
    for block in model.blocks:
        block.whole_layer_calls = whole
    kv = lm.new_cache()  # type: ignore[attr-defined]
    tok = int(prefill(model, [1, 5, 9, 2, 7], kv).argmax())
    logits, routes = [], []
    for _ in range(n):
        out = decode_one(model, tok, kv)
        logits.append(out)
        routes.append(model.routing())
        tok = int(out.argmax())
    return logits, routes


def _taken(lm: object) -> int:
    """How many layers the two-call path takes for one token now."""
    model = lm.model  # type: ignore[attr-defined]
    kv = lm.new_cache()  # type: ignore[attr-defined]
    x = model.embed_tokens(torch.tensor([3]))
    return sum(
        b.decode_layer(x, 0, kv.layers[i], model.rope, model.experts) is not None for i, b in enumerate(model.blocks)
    )


@pytest.mark.parametrize("kernels", ["int16", "int8"])
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_two_calls_per_layer_give_the_per_part_paths_bits(arch: str, kernels: str, tmp_path: Path) -> None:
    """Attention block, then FFN norm + routed experts + residual in one call: the same logits, bit for bit,
    and the same recorded routing as the attention block, norm, experts and add taken one by one (gpt-oss:
    sinks, biases, sliding-window layers, MXFP4)."""
    qtype, dense = (Q.MXFP4, Q.Q8_0) if arch == "gpt-oss" else (Q.Q4_K, Q.Q4_K)
    path = tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=qtype, dense_type=dense)
    lm = load_model(path, n_ctx=64, cpu_kernels=kernels)
    assert _taken(lm) == len(lm.model.blocks)
    whole, whole_routes = _steps(lm, True)
    parts, part_routes = _steps(lm, False)
    for a, b in zip(whole, parts, strict=True):
        assert torch.equal(a, b)
    assert whole_routes == part_routes
    assert all(len(r) == len(lm.model.moe_layers) for r in whole_routes)
    lm.close()


def test_the_calls_follow_new_bits_and_the_expert_cache(tmp_path: Path) -> None:
    """The calls bind the activations' bits and the executor: after other bits the layer computes with them
    (the per-part path's bits again); behind an expert cache that prefetches it takes the cache's path, and
    back without it; behind slots that are the host copy it keeps its calls."""
    lm = load_model(tiny_moe(tmp_path / "q.gguf", expert_type=Q.Q4_K, dense_type=Q.Q8_0), n_ctx=64, cpu_kernels="int8")
    int8, _ = _steps(lm, True)
    set_activation_bits(lm.model, 16, 16)
    lm.model.host_experts.set_bits(16, 16)
    int16, _ = _steps(lm, True)
    int16_parts, _ = _steps(lm, False)
    assert all(torch.equal(a, b) for a, b in zip(int16, int16_parts, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(int8, int16, strict=True))  # the bits did change the result
    lm.close()
    path = tiny_moe(tmp_path / "c.gguf", dense_type=Q.Q8_0)
    # A cache that prefetches acts on its plan before the experts run: the cache's own path.
    cached = load_model(path, n_ctx=64, cache=CacheSettings(mib=0.5, cpu_share=0.5, prefetch=True))
    assert _taken(cached) == 0
    cached.model.experts = cached.model.host_experts
    assert _taken(cached) == len(cached.model.blocks)
    cached.close()
    # Slots that are the host copy: the two calls, the lookups told to the cache after the token.
    in_place = load_model(path, n_ctx=64, cache=CacheSettings(mib=0.5, cpu_share=0.5))
    assert _taken(in_place) == len(in_place.model.blocks)
    in_place.close()


@pytest.mark.parametrize("arch", ["qwen2moe", "olmoe", "deepseek2"])
def test_layers_without_the_two_calls_take_the_per_part_path(arch: str, tmp_path: Path) -> None:
    """A shared expert (qwen2moe), a QK norm over the whole projection (olmoe), latent attention and grouped
    choice (deepseek2): no two-call layer; decode runs as before."""
    lm = load_model(tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=Q.Q8_0, dense_type=Q.Q8_0), n_ctx=64)
    blocks = [b for b in lm.model.blocks if isinstance(b, Block) and isinstance(b.ffn, MoeFFN)]
    assert blocks
    kv = KVCache(lm.config, 64)
    x = lm.model.embed_tokens(torch.tensor([3]))
    for i, b in enumerate(lm.model.blocks):
        if b in blocks:
            assert b.decode_layer(x, 0, kv.layers[i], lm.model.rope, lm.model.experts) is None
    whole, _ = _steps(lm, True, 2)
    parts, _ = _steps(lm, False, 2)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
    lm.close()


def test_a_dense_lead_layer_leaves_the_moe_layers_their_two_calls(tmp_path: Path) -> None:
    """A dense first layer (DeepSeek-style lead layers) has no two-call form: the token goes layer by layer,
    the MoE layers still in two calls each, with the per-part path's bits."""
    path = tiny_moe(tmp_path / "lead.gguf", n_layers=3, dense_layers=1, expert_type=Q.Q4_K, dense_type=Q.Q4_K)
    lm = load_model(path, n_ctx=64)
    assert _taken(lm) == 2
    whole, whole_routes = _steps(lm, True)
    parts, part_routes = _steps(lm, False)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
    assert whole_routes == part_routes
    lm.close()


def test_the_calls_keep_no_kv_cache_alive(tmp_path: Path) -> None:
    """The blocks keep their calls between tokens but bind no KV cache memory (a finished chat's cache
    must be freed), and the next cache gets its own positions (the per-part path's logits on it)."""
    lm = load_model(tiny_moe(tmp_path / "q.gguf", expert_type=Q.Q4_K, dense_type=Q.Q8_0), n_ctx=64)
    kv = lm.new_cache()
    tok = int(prefill(lm.model, [1, 5, 9], kv).argmax())
    decode_one(lm.model, tok, kv)
    assert _taken(lm) == len(lm.model.blocks)
    cache_arrays = [a.numpy() for layer in kv.layers for a in (layer.k, layer.v)]
    for block in lm.model.blocks:
        calls = block._calls
        assert calls is not None and calls.attention is not None and calls.ffn is not None
        bound = [*calls.attention.head, *calls.attention.tail, *calls.ffn.head, *calls.ffn.tail, *vars(calls).values()]
        held = [a for a in bound if isinstance(a, np.ndarray)]
        assert held  # (the weights are bound)
        assert not any(np.shares_memory(a, c) for a in held for c in cache_arrays)
    whole, _ = _steps(lm, True, 3)
    parts, _ = _steps(lm, False, 3)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
    lm.close()
