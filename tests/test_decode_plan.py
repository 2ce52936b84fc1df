"""A decode token runs the model's decode plan (models.decode_plan): its compiled halves against the modules' own."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.generate import decode_one, prefill
from moechat.engine.loader import load_model
from moechat.engine.models.decode_plan import DecodePlan
from moechat.engine.models.decoder import Block
from testkit.ggufgen import Q, tiny_moe

ROOT = Path(__file__).resolve().parents[1]


def _steps(lm: Any, compiled: bool, n: int = 5) -> tuple[list[torch.Tensor], list[tuple[tuple[int, ...], ...]]]:
    """n greedy decode steps after a short prompt, on the model's plan or on one of module halves only:
    logits and routing."""
    model = lm.model
    kv = lm.new_cache()
    model.drop_plans()
    if not compiled:
        kind = (kv.device.type, kv.layers[0].k.dtype)
        model._plans[kind] = DecodePlan.build(model, kind, compiled=False)
    tok = int(prefill(model, [1, 5, 9, 2, 7], kv).argmax())
    logits, routes = [], []
    for _ in range(n):
        out = decode_one(model, tok, kv)
        logits.append(out)
        routes.append(model.routing())
        tok = int(out.argmax())
    model.drop_plans()
    return logits, routes


def _kinds(lm: Any) -> list[tuple[str, str]]:
    """Each layer's halves in the plan a token now gets."""
    return [p.kinds for p in lm.model.decode_plan(lm.new_cache()).layers]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-4 * float(y.abs().max()))


@pytest.mark.parametrize("kernels", ["int16", "int8"])
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_compiled_layers_compute_what_the_modules_compute(arch: str, kernels: str, tmp_path: Path) -> None:
    """Every layer as two compiled calls (attention block; FFN norm, routing, routed experts, residual) in one
    loop: the logits of the modules' halves run one by one, to float rounding, the same greedy tokens and
    the same recorded routing (gpt-oss: sinks, biases, sliding-window layers, MXFP4)."""
    qtype, dense = (Q.MXFP4, Q.Q8_0) if arch == "gpt-oss" else (Q.Q4_K, Q.Q4_K)
    path = tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=qtype, dense_type=dense)
    lm = load_model(path, n_ctx=64, cpu_kernels=kernels)
    plan = lm.model.decode_plan(lm.new_cache())
    assert [p.kinds for p in plan.layers] == [("compiled", "compiled")] * len(lm.model.blocks)
    assert all(p.calls is not None for p in plan.layers)  # the tight loop
    fast, fast_routes = _steps(lm, True)
    ref, ref_routes = _steps(lm, False)
    _close(fast, ref)
    assert [int(x.argmax()) for x in fast] == [int(x.argmax()) for x in ref]
    assert fast_routes == ref_routes
    assert all(len(r) == len(lm.model.moe_layers) for r in fast_routes)
    lm.close()


@pytest.mark.parametrize(
    ("arch", "kinds"),
    [
        ("qwen2moe", {("compiled", "routed call")}),  # a shared expert beside the routed call
        ("olmoe", {("module", "compiled")}),  # QK norms over the whole projection: no compiled attention
        ("deepseek2", {("module", "compiled"), ("module", "module")}),  # latent attention; grouped choice
        ("qwen3next", {("module", "routed call")}),  # linear and gated attention; a shared expert
    ],
)
def test_each_layer_gets_the_calls_its_weights_allow(arch: str, kinds: set[tuple[str, str]], tmp_path: Path) -> None:
    """Layers the kernels have no whole form for run the modules' halves in the plan, and decode computes
    what the modules compute."""
    lm = load_model(tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=Q.Q8_0, dense_type=Q.Q8_0), n_ctx=64)
    assert set(_kinds(lm)) == kinds
    fast, _ = _steps(lm, True, 3)
    ref, _ = _steps(lm, False, 3)
    _close(fast, ref)
    lm.close()


@pytest.mark.parametrize("dense_layers", [1, 3])
def test_dense_layers_run_their_compiled_ffn(dense_layers: int, tmp_path: Path) -> None:
    """A dense first layer (DeepSeek-style lead layers), or a dense model: a dense FFN in one call, in the same
    loop over host rows as the MoE layers' calls, with the modules' results."""
    path = tiny_moe(tmp_path / "lead.gguf", n_layers=3, dense_layers=dense_layers, expert_type=Q.Q4_K,
                    dense_type=Q.Q4_K, n_expert=8 if dense_layers < 3 else 0)  # fmt: skip
    lm = load_model(path, n_ctx=64)
    plan = lm.model.decode_plan(lm.new_cache())
    assert [p.kinds for p in plan.layers] == [("compiled", "compiled")] * 3
    assert all(p.calls is not None for p in plan.layers)
    assert [p.moe is not None for p in plan.layers] == [i >= dense_layers for i in range(3)]
    assert plan.describe() == "layers 0-2: attention compiled, FFN compiled"
    fast, fast_routes = _steps(lm, True)
    ref, ref_routes = _steps(lm, False)
    _close(fast, ref)
    assert fast_routes == ref_routes
    assert all(len(r) == 3 - dense_layers for r in fast_routes)
    lm.close()


def test_the_plan_follows_new_bits_and_the_expert_cache(tmp_path: Path) -> None:
    """The plan binds the activations' bits and the executor, and is made again when either changes: after
    other bits the layers compute with them; behind slots that are the host copy they keep their calls and
    the cache is told each token's lookups, with its look-ahead where the cache prefetches."""
    lm = load_model(tiny_moe(tmp_path / "q.gguf", expert_type=Q.Q4_K, dense_type=Q.Q8_0), n_ctx=64, cpu_kernels="int8")
    int8, _ = _steps(lm, True)
    lm.model.set_activation_bits(16, 16)
    int16, _ = _steps(lm, True)
    assert not all(torch.equal(a, b) for a, b in zip(int8, int16, strict=True))  # the bits did change the result
    ref16, _ = _steps(lm, False)
    _close(int16, ref16)
    lm.close()
    path = tiny_moe(tmp_path / "c.gguf", dense_type=Q.Q8_0)
    cached = load_model(path, n_ctx=64, cache=CacheSettings(mib=0.5, cpu_share=0.5, prefetch="next-layer"))
    assert {f for _, f in _kinds(cached)} == {"compiled"}
    assert cached.model.decode_plan(cached.new_cache()).prefetch
    assert cached.cache is not None
    _steps(cached, True, 4)
    t = cached.cache.snapshot().total
    assert t.predicted > 0 and t.prefetched > 0  # the token calls told the cache their predictions
    cached.model.experts = cached.model.host_experts
    assert {f for _, f in _kinds(cached)} == {"compiled"}
    assert not cached.model.decode_plan(cached.new_cache()).prefetch
    cached.close()
    in_place = load_model(path, n_ctx=64, cache=CacheSettings(mib=0.5, cpu_share=0.5))
    assert {f for _, f in _kinds(in_place)} == {"compiled"}
    assert in_place.cache is not None
    before = in_place.cache.tokens
    _steps(in_place, True, 4)
    assert in_place.cache.tokens > before  # the lookups were stepped
    in_place.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "deepseek2", "qwen3next"])
def test_decode_runs_through_the_plan_alone(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the prompt, a token never goes through a block's forward (the prompt's path): the plan runs it."""
    lm = load_model(tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=Q.Q8_0, dense_type=Q.Q8_0), n_ctx=64)
    kv = lm.new_cache()
    tok = int(prefill(lm.model, [1, 5, 9], kv).argmax())

    def refused(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a decode token went through Block.forward")

    monkeypatch.setattr(Block, "forward", refused)
    for _ in range(3):
        tok = int(decode_one(lm.model, tok, kv).argmax())
    with pytest.raises(AssertionError, match="Block.forward"):
        prefill(lm.model, [tok, 4], kv)  # (the patch does bite where blocks run)
    lm.close()


def test_the_plan_keeps_no_kv_cache_alive(tmp_path: Path) -> None:
    """The plan is kept between tokens but binds no KV cache memory (a finished chat's cache must be freed),
    and the next cache gets its own positions (the modules' logits on it)."""
    lm = load_model(tiny_moe(tmp_path / "q.gguf", expert_type=Q.Q4_K, dense_type=Q.Q8_0), n_ctx=64)
    kv = lm.new_cache()
    tok = int(prefill(lm.model, [1, 5, 9], kv).argmax())
    decode_one(lm.model, tok, kv)
    plan = lm.model.decode_plan(kv)
    cache_arrays = [a.numpy() for layer in kv.layers for a in (layer.k, layer.v)]
    for p in plan.layers:
        assert p.calls is not None
        attention, ffn = p.calls
        bound = [*attention.head, *attention.tail, *ffn.head, *ffn.tail]
        held = [a for a in bound if isinstance(a, np.ndarray)]
        assert held  # (the weights are bound)
        assert not any(np.shares_memory(a, c) for a in held for c in cache_arrays)
    fast, _ = _steps(lm, True, 3)
    ref, _ = _steps(lm, False, 3)
    _close(fast, ref)
    lm.close()


def test_the_model_files_hold_no_one_token_path() -> None:
    """How one token runs is the plan's to choose: the decoder and the family files branch on no token count."""
    one_token = re.compile(r"shape\[0\] (==|<=) 1\b|\bt == 1\b|\b(T|n_tokens|rows) == 1\b")
    for path in sorted((ROOT / "engine" / "models").glob("*.py")):
        if path.name == "decode_plan.py":
            continue
        lines = path.read_text().splitlines()
        # The one place a token count is read: run_blocks hands one token to the plan.
        hits = [
            a for a, b in zip(lines, [*lines[1:], ""], strict=True) if one_token.search(a) and "decode_plan(" not in b
        ]
        assert not hits, f"{path.name}: {hits}"
