"""A layer's halves for one token in one compiled call each, against the torch path they replace at decode."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize as gguf_dequantize
from moechat.engine.kernels.attention_core import LANES, rows_fit
from moechat.engine.kernels.codes import (
    ACT_GELU_TANH,
    ACT_SILU,
    GATING_SELECT,
    GATING_SIGMOID,
    GATING_SOFTMAX,
    GATING_SOFTMAX_SELECTED,
)
from moechat.engine.kernels.jit import njit
from moechat.engine.kernels.layer_halves import (
    FfnBlockCall,
    decode_attention,
    exp_nonpositive,
    route_rows,
    router_logits,
    select_compiled,
)
from moechat.engine.moe.routing import route
from moechat.engine.nn.layers import LayerCache, Rope, attention, head_major, host_heads
from testkit.ggufgen import Q, quantized


@pytest.mark.parametrize(
    ("n_head", "n_kv", "dim", "rope_dim", "neox", "window", "sink"),
    [(4, 4, 16, 16, True, 0, False), (8, 2, 32, 32, False, 0, False), (6, 3, 32, 16, True, 5, True),
     (9, 3, 64, 64, False, 0, True), (16, 4, 32, 32, True, 0, False), (10, 5, 64, 64, True, 11, True),
     (32, 4, 64, 64, True, 0, False), (24, 4, 32, 32, False, 20, True), (8, 4, 36, 36, True, 0, False)],
)  # fmt: skip
def test_decode_attention_matches_the_torch_path(n_head: int, n_kv: int, dim: int, rope_dim: int, neox: bool,
                                                 window: int, sink: bool) -> None:  # fmt: skip
    torch.manual_seed(0)
    n_ctx, scale = 48, dim**-0.5
    sinks = torch.randn(n_head) * 2 if sink else None  # gpt-oss's attention sinks
    rope = Rope(rope_dim, 10000.0, n_ctx, neox=neox)
    ref_cache = LayerCache(head_major(n_ctx, n_kv, dim), head_major(n_ctx, n_kv, dim))
    cache = LayerCache(head_major(n_ctx, n_kv, dim), head_major(n_ctx, n_kv, dim))
    # Each position attends to all earlier ones (or the window's): counts of positions that are and are
    # not a multiple of the vector loops' LANES (fewer than LANES: the plain loops), with and without the
    # window's start inside; query heads per KV head 8, 4 to 7 and 1 to 3 (the value loops' three forms),
    # and a head dim of 36 (not whole vectors: the plain loops).
    for pos in range(42):
        q, k, v = torch.randn(1, n_head, dim), torch.randn(1, n_kv, dim), torch.randn(1, n_kv, dim)
        p = torch.tensor([pos])
        ref = attention(rope(q, p), ref_cache, rope(k, p), v, pos, scale=scale, window=window, sinks=sinks)  # [1, H, D]
        got = decode_attention(q[0].numpy().copy(), k[0].numpy().copy(), v[0].numpy().copy(), rope.parts(), neox,
                               *host_heads(cache), pos, window, scale,
                               None if sinks is None else sinks.numpy())  # fmt: skip
        torch.testing.assert_close(torch.from_numpy(got), ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.k[: pos + 1], ref_cache.k[: pos + 1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache.v[: pos + 1], ref_cache.v[: pos + 1])


def test_a_model_cache_takes_the_vector_loops() -> None:
    """The KV cache a model makes is read by `attention_core`'s loops, not the plain ones, for the usual
    head dims: a layout that lost its row-contiguity would fall back silently (and run slower)."""
    from moechat.engine.kernels.attention_core import LANES, fits

    for dim in (64, 128, 256):
        k, v = host_heads(LayerCache(head_major(40, 4, dim), head_major(40, 4, dim)))
        q = np.zeros((8, dim), np.float32)
        assert k.flags.c_contiguous and v.flags.c_contiguous
        assert fits(q, k, v, LANES) and not fits(q, k, v, LANES - 1)
    k, v = host_heads(LayerCache(head_major(40, 4, 36), head_major(40, 4, 36)))
    assert not fits(np.zeros((8, 36), np.float32), k, v, 32)


@pytest.mark.parametrize(("act_code", "residual"), [(ACT_SILU, True), (ACT_GELU_TANH, False)])
def test_ffn_block_matches_dequantized_weights(act_code: int, residual: bool) -> None:
    """Norm, gate and up with the activation, down, post-norm and residual in one call, against float32."""
    rng = np.random.default_rng(2)
    e, f = 256, 512
    raws = [quantized((f, e), Q.Q4_K, rng), quantized((f, e), Q.Q8_0, rng), quantized((e, f), Q.Q6_K, rng)]
    types = (Q.Q4_K, Q.Q8_0, Q.Q6_K)
    gate, up, down = (torch.from_numpy(gguf_dequantize(r, t).reshape(r.shape[0], -1)).double()
                      for r, t in zip(raws, types, strict=True))  # fmt: skip
    x = torch.from_numpy(rng.standard_normal((1, e)).astype(np.float32))
    norm, post = torch.rand(e) + 0.5, torch.rand(e) + 0.5
    got = FfnBlockCall(norm.numpy(), 1e-6, tuple(zip(raws, types, strict=True)), act_code, post.numpy(),
                       residual)(x.numpy())  # fmt: skip
    h = F.rms_norm(x.double(), (e,), norm.double(), 1e-6)
    g, u = h @ gate.T, h @ up.T
    a = F.silu(g) * u if act_code == ACT_SILU else F.gelu(g, approximate="tanh") * u
    ref = F.rms_norm(a @ down.T, (e,), post.double(), 1e-6) + (x.double() if residual else 0)
    assert float((torch.from_numpy(got).double() - ref).abs().max() / ref.abs().max()) <= 2e-4  # two products


@pytest.mark.parametrize("gating", [GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_SELECTED, GATING_SELECT])
@pytest.mark.parametrize("norm", [False, True])
def test_compiled_routing_matches_route(gating: int, norm: bool) -> None:
    gen = torch.Generator().manual_seed(gating + 7 * norm)
    h, router, bias = (
        torch.randn(3, 64, generator=gen),
        torch.randn(24, 64, generator=gen),
        torch.randn(24, generator=gen),
    )
    cfg = SimpleNamespace(n_expert_used=4, expert_gating=gating, expert_weights_norm=norm, expert_weights_scale=2.5,
                          expert_groups=1, expert_groups_used=1)  # fmt: skip
    ids, weights = route(F.linear(h, router, bias), cfg)
    got_ids, got_w = route_rows(h.numpy(), router.numpy(), bias.numpy(), gating, 4, norm, 2.5)
    np.testing.assert_array_equal(got_ids, ids.numpy())
    np.testing.assert_allclose(got_w, weights.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gating", [GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_SELECTED, GATING_SELECT])
@pytest.mark.parametrize(("choice_bias", "groups", "groups_used"), [(False, 1, 1), (True, 1, 1), (True, 8, 3),
                                                                     (False, 4, 2)])  # fmt: skip
def test_the_routing_rule_is_the_papers(gating: int, choice_bias: bool, groups: int, groups_used: int) -> None:
    """The compiled rule (a decode token's) against `route` (a prompt's, in torch), with the choice bias that
    steers the choice but not the weights, and DeepSeek's groups, of which only the best compete."""
    gen = torch.Generator().manual_seed(gating + 10 * groups + choice_bias)
    logits, bias = torch.randn(9, 64, generator=gen), torch.rand(64, generator=gen)
    cfg = SimpleNamespace(n_expert_used=6, expert_gating=gating, expert_weights_norm=groups > 1,
                          expert_weights_scale=2.5, expert_groups=groups, expert_groups_used=groups_used)  # fmt: skip
    choice = bias.numpy() if choice_bias else np.zeros(0, np.float32)
    got_ids, got_w = select_compiled(
        logits.numpy(), gating, 6, groups > 1, np.float32(2.5), choice, groups, groups_used
    )
    ids, want_w = route(logits, cfg, bias if choice_bias else None)
    assert np.array_equal(got_ids, ids.numpy())
    np.testing.assert_allclose(got_w, want_w.numpy(), rtol=1e-5, atol=1e-6)
    if groups > 1 and gating != GATING_SELECT:  # every choice from the kept groups only (selection only: no groups)
        assert all(len({int(e) // (64 // groups) for e in row}) <= groups_used for row in ids)


@pytest.mark.parametrize(
    ("rows", "n_expert", "dim"), [(1, 128, 2048), (3, 24, 64), (8, 130, 128), (2, 10, 64), (1, 32, 72)]
)
def test_router_logits_in_vectors_and_loops(rows: int, n_expert: int, dim: int) -> None:
    """The router's logits against float64, in whole vectors (a last block of experts overlapping the one
    before) and in the loops (fewer experts than a vector's lanes on AVX-512, or dims not in whole vectors)."""
    rng = np.random.default_rng(n_expert * dim + rows)
    h = rng.standard_normal((rows, dim)).astype(np.float32)
    router = rng.standard_normal((n_expert, dim)).astype(np.float32)
    bias = rng.standard_normal(n_expert).astype(np.float32)
    assert rows_fit(h, router) == (dim % LANES == 0 and n_expert >= LANES)  # AVX-512: 10 experts or 72 dims loop
    want = h.astype(np.float64) @ router.T.astype(np.float64) + bias
    for b in (bias, np.zeros(0, np.float32)):
        got = router_logits(h, router, b)
        ref = want if b.size else want - bias
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(h).sum(axis=1).max() * np.abs(router).max()


def test_decode_attention_refuses_a_position_past_the_cache() -> None:
    rope = Rope(16, 10000.0, 8, neox=True)
    cache = LayerCache(head_major(8, 2, 16), head_major(8, 2, 16))
    q, kv = np.zeros((2, 16), np.float32), np.zeros((2, 16), np.float32)
    with pytest.raises(IndexError, match="outside the KV cache"):
        decode_attention(q, kv, kv.copy(), rope.parts(), True, *host_heads(cache), 8, 0, 0.25)


@pytest.mark.parametrize(("n_tok", "n_head", "dk", "dv"), [(1, 4, 16, 16), (7, 3, 32, 24), (40, 2, 8, 64)])
def test_compiled_delta_rule_matches_the_torch_recurrence(n_tok: int, n_head: int, dk: int, dv: int) -> None:
    """Linear attention's recurrence (Qwen3-Next), from a non-zero state: outputs and the state left behind."""
    from moechat.engine.models.qwen3next import delta_rule, delta_rule_torch

    torch.manual_seed(n_tok)
    q = F.normalize(torch.randn(n_tok, n_head, dk), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(n_tok, n_head, dk), dim=-1)
    v = torch.randn(n_tok, n_head, dv)
    decay, beta = torch.rand(n_tok, n_head) * 0.5 + 0.5, torch.rand(n_tok, n_head)
    start = torch.randn(n_head, dk, dv)
    state, ref_state = start.clone(), start.clone()
    out = delta_rule(q, k, v, decay, beta, state)
    ref = delta_rule_torch(q, k, v, decay, beta, ref_state)
    assert not torch.equal(state, start)
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert float((state - ref_state).abs().max()) <= 1e-5 * float(ref_state.abs().max())


@pytest.mark.parametrize("window", [0, 6])
def test_attention_sinks_in_the_fused_attention_are_a_softmax_logit_without_a_value(window: int) -> None:
    """gpt-oss's sinks ride in torch's fused attention as one more key: the same as the softmax over the
    scores and each head's sink logit, for a prompt and for the token after it."""
    torch.manual_seed(0)
    n_head, n_kv, dim, t = 6, 2, 16, 9
    sinks = torch.randn(n_head) * 2
    cache = LayerCache(head_major(32, n_kv, dim), head_major(32, n_kv, dim))
    keys, values = torch.randn(t + 1, n_kv, dim), torch.randn(t + 1, n_kv, dim)
    queries = torch.randn(t + 1, n_head, dim)

    def step(a: int, b: int) -> torch.Tensor:  # positions a..b-1 after those before a
        return attention(queries[a:b], cache, keys[a:b], values[a:b], a, scale=0.25, window=window, sinks=sinks)

    got = torch.cat([step(0, t), step(t, t + 1)])
    group = n_head // n_kv
    for i in range(t + 1):  # each position by the formula: softmax over its visible keys and the sink
        first = max(0, i - window + 1) if window else 0
        for h in range(n_head):
            scores = keys[first : i + 1, h // group] @ queries[i, h] * 0.25
            probs = torch.softmax(torch.cat([scores, sinks[h : h + 1]]), 0)[:-1]
            want = probs @ values[first : i + 1, h // group]
            torch.testing.assert_close(got[i, h], want, rtol=1e-5, atol=1e-6)
    assert got.shape == (t + 1, n_head, dim)


@njit(fastmath={"reassoc", "contract"})  # the attention kernel's flags: they must not undo the split of ln 2
def _exps(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = exp_nonpositive(x[i])
    return out


def test_the_softmax_exp_is_within_its_bound() -> None:
    rng = np.random.default_rng(5)
    x = -np.concatenate([np.linspace(0, 87, 400_001), rng.random(10_000) * 1e-3]).astype(np.float32)
    got, ref = _exps(x).astype(np.float64), np.exp(x.astype(np.float64))
    assert float((np.abs(got - ref) / ref).max()) <= 2e-7
    low = np.array([-87.7, -88.0, -200.0, -np.inf], np.float32)  # below float32's normal range: 0, not garbage
    np.testing.assert_array_equal(_exps(low), np.zeros(4, np.float32))
