"""Every MoE architecture end to end, against transformers holding the same weights (fp32)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from moechat.engine.events import GREEDY, DoneEvent, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.gguf.quant_types import CPU, supports
from moechat.engine.loader import LoadedModel, load_model
from moechat.engine.nn.layers import QuantRows
from moechat.engine.nn.qlinear import QLinear
from testkit.ggufgen import Q, tiny_moe
from testkit.hf_ref import hf_reference

PROMPT = "The history of the city begins with a small fishing village on the river, where traders met"


# A quantized file's dense matrices run through the CPU kernels too: the "mixed" cases quantize
# attention, shared experts, embedding and output as real files do (Q4_K_M: Q4_K with Q6_K down
# projections and output; gpt-oss: MXFP4 experts with Q8_0 elsewhere).
MIXES: dict[str, dict[str, Any]] = {
    "q4km": {"dense_type": Q.Q4_K, "down_type": Q.Q6_K, "ends_type": Q.Q4_K, "output_type": Q.Q6_K},
    "q8": {"dense_type": Q.Q8_0, "ends_type": Q.Q8_0},
}
CASES = [
    ("qwen3moe", Q.F32, ""), ("qwen3moe", Q.Q8_0, ""), ("qwen3moe", Q.Q4_K, ""), ("qwen3moe", Q.Q6_K, ""),
    ("qwen3moe", Q.Q4_K, "q4km"),
    ("qwen2moe", Q.F32, ""), ("qwen2moe", Q.Q8_0, ""), ("qwen2moe", Q.Q4_K, "q4km"),
    ("llama", Q.F32, ""), ("llama", Q.Q4_K, ""),
    ("olmoe", Q.F32, ""), ("olmoe", Q.Q6_K, ""),
    ("gpt-oss", Q.F32, ""), ("gpt-oss", Q.MXFP4, ""), ("gpt-oss", Q.MXFP4, "q8"),
    ("glm4moe", Q.F32, ""), ("glm4moe", Q.Q8_0, ""), ("glm4moe", Q.Q4_K, "q4km"),
    ("deepseek2", Q.F32, ""), ("deepseek2", Q.Q8_0, ""), ("deepseek2", Q.Q4_K, "q4km"),
    ("qwen3next", Q.F32, ""), ("qwen3next", Q.Q8_0, ""), ("qwen3next", Q.Q4_K, "q4km"),
    ("qwen35moe", Q.F32, ""), ("qwen35moe", Q.Q8_0, ""), ("qwen35moe", Q.Q4_K, "q4km"),
]  # fmt: skip


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join([c[0], c[1].name, *([c[2]] if c[2] else [])]))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    arch, qtype, mix = request.param
    path = tiny_moe(tmp_path_factory.mktemp("m") / f"{arch}-{qtype.name}.gguf", arch=arch, expert_type=qtype,
                    **MIXES.get(mix, {}))  # fmt: skip
    return load_model(path, n_ctx=256, cpu_kernels="int16")  # the tolerances below are int16's


# The fast path (int16 activations, within 1e-4 per product) against the exact one, end to end: a
# router's near-tie can pick another expert for a token, which moves its logits by about 1e-3.
FAST_VS_EXACT = 5e-3
NEAR_TIE = 1e-3  # of the largest logit: a greedy pick the fast path's rounding may flip


def _exact(model: LoadedModel) -> LoadedModel:
    return load_model(model.gguf.path, n_ctx=256, cpu_kernels="exact")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


@pytest.mark.slow
def test_logits_match_transformers(model: LoadedModel) -> None:
    """The exact path (dequantize, then float32 matmuls) is the reference implementation."""
    exact = _exact(model)
    ids = exact.tokenizer.encode(PROMPT)[:32]
    assert len(ids) == 32
    with torch.inference_mode():
        ours = exact.model(torch.tensor(ids), 0, exact.new_cache())
        ref = hf_reference(exact.gguf, exact.config)(torch.tensor([ids])).logits[0]
    assert _rel(ours, ref) <= 1e-4


def test_fast_path_agrees_with_the_exact_path(model: LoadedModel) -> None:
    exact = _exact(model)
    ids = model.tokenizer.encode(PROMPT)[:32]
    with torch.inference_mode():
        for n in (32, 1):  # prefill (float GEMM for dense matrices, kernels for experts), and decode
            fast = model.model(torch.tensor(ids[:n]), 0, model.new_cache())
            ref = exact.model(torch.tensor(ids[:n]), 0, exact.new_cache())
            assert _rel(fast, ref) <= FAST_VS_EXACT, n


def test_quantized_matrices_run_from_the_file_bytes(model: LoadedModel) -> None:
    """The fast path is really taken: no float copy of a quantized matrix a kernel can read."""
    host = model.model.host_experts
    layer = next(iter(host.layers))
    assert host.fused[layer] == supports(host.layers[layer].gate.qtype, CPU)
    attn = model.model.blocks[0].attn
    q = ("attn_q_a", attn.q_a) if model.config.kv_lora_rank else ("attn_q", getattr(attn, "wq", None))
    if model.config.is_recurrent(0):  # linear attention
        q = ("attn_qkv", attn.w_qkv)
    for w, name in ((q[1], f"blk.0.{q[0]}.weight"), (model.model.output, "output.weight")):
        assert isinstance(w, QLinear) == supports(model.gguf.tensors[name].qtype, CPU), name
    assert isinstance(model.model.embed, QuantRows)  # rows looked up in the file, whatever their type


def test_incremental_decode_equals_one_batch(model: LoadedModel) -> None:
    ids = model.tokenizer.encode(PROMPT)[:20]
    with torch.inference_mode():
        full = model.model(torch.tensor(ids), 0, model.new_cache())
        cache = model.new_cache()
        first = model.model(torch.tensor(ids[:12]), 0, cache)
        steps = [model.model(torch.tensor([t]), cache.pos, cache) for t in ids[12:]]
    inc = torch.cat([first, *steps])
    # Batched matmuls of a type without prompt tiles run a float GEMM, one token the kernels with
    # int16 activations (within 1e-4 per product, tests/test_cpu_kernels.py); a router's near-tie
    # can differ: small differences (8e-4 of the largest logit measured on a 2-core AVX-512 Xeon),
    # never the O(1) of a wrong cache position or mask.
    assert float((inc - full).abs().max()) <= FAST_VS_EXACT * float(full.abs().max())


def test_greedy_continuation_matches_transformers(model: LoadedModel) -> None:
    prompt = model.tokenizer.encode(PROMPT)
    events = list(generate(model.model, model.tokenizer, prompt, model.new_cache(), max_tokens=32,
                           params=GREEDY, ignore_eos=True))  # fmt: skip
    ours = [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.n_generated == 32 and done.stop_reason == "length"
    hf = hf_reference(model.gguf, model.config)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                          eos_token_id=None, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)  # fmt: skip
    theirs = out.sequences[0, len(prompt) :].tolist()
    if ours != theirs:
        # The fast path rounds activations (within 1e-4 per product): it may take the other side
        # of a near-tie, never a token the reference ranks clearly lower. After that the two
        # continuations differ by construction.
        i = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        logits = out.scores[i][0]
        gap = float(logits.max() - logits[ours[i]])
        assert gap <= NEAR_TIE * float(logits.abs().max()), (i, gap)


@pytest.mark.slow
def test_cli_run(tmp_path: Path) -> None:
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=512)
    base = [sys.executable, "-m", "moechat", "run", str(model), "-p", "Hello there", "-n", "12", "--ignore-eos"]
    a = subprocess.run([*base, "--seed", "7"], capture_output=True, text=True, timeout=120)
    b = subprocess.run([*base, "--seed", "7"], capture_output=True, text=True, timeout=120)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    assert "generation: 12 tokens" in a.stderr and "prompt:" in a.stderr and "t/s" in a.stderr
    cmd = [sys.executable, "-m", "moechat", "run", str(model), "-p", "word " * 400, "-c", "64"]
    long = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert long.returncode == 2 and "Traceback" not in long.stderr
    assert "the context holds 64" in long.stderr.strip().splitlines()[-1]


def test_one_kv_head_with_per_head_qk_norms(tmp_path: Path) -> None:
    # With one KV head the per-head k norm has the size of the whole k projection: it must apply once.
    path = tiny_moe(tmp_path / "kv1.gguf", n_head_kv=1, expert_type=Q.F32)
    lm = load_model(path, n_ctx=64)
    ids = lm.tokenizer.encode(PROMPT)[:16]
    with torch.inference_mode():
        ours = lm.model(torch.tensor(ids), 0, lm.new_cache())
        ref = hf_reference(lm.gguf, lm.config)(torch.tensor([ids])).logits[0]
    assert float((ours - ref).abs().max() / ref.abs().max()) <= 1e-4


@pytest.mark.parametrize(("arch", "qtype"), [("llama", Q.F32), ("llama", Q.Q4_K), ("qwen2", Q.Q8_0), ("qwen3", Q.F32)])
def test_dense_models_match_transformers(tmp_path: Path, arch: str, qtype: Q) -> None:
    # Dense models (no experts) run on the same decoder, with their family's biases and QK norms.
    # int16: the tolerances below are int16's (the default's prompt tiles are int8 where the CPU has VNNI)
    path = tiny_moe(tmp_path / "dense.gguf", arch=arch, n_expert=0, dense_type=qtype)
    lm = load_model(path, n_ctx=128, cpu_kernels="int16")
    assert not lm.config.is_moe and not lm.model.host_experts.layers and lm.cache is None
    ids = lm.tokenizer.encode(PROMPT)[:32]
    with torch.inference_mode():
        ours = lm.model(torch.tensor(ids), 0, lm.new_cache())
        ref = hf_reference(lm.gguf, lm.config)(torch.tensor([ids])).logits[0]
    # A prompt meets a super-block type's matrices in the kernels' integer tiles (int16 activations).
    tiled = any(isinstance(w, QLinear) and w.tiled for m in lm.model.modules() for w in vars(m).values())
    assert tiled == (qtype == Q.Q4_K)
    assert float((ours - ref).abs().max() / ref.abs().max()) <= (FAST_VS_EXACT if tiled else 1e-4)
    assert lm.model.routing() == ()


def test_dense_lead_layers_stay_out_of_the_expert_cache(tmp_path: Path) -> None:
    # Layer 0 has a dense FFN, layers 1-2 route: the cache, its statistics and its trace see only
    # the MoE layers, by their real index, and the cache still changes nothing the model computes.
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.cache.trace import read_trace

    path = tiny_moe(tmp_path / "lead.gguf", n_layers=3, dense_layers=1)
    plain = load_model(path, n_ctx=128)
    assert sorted(plain.model.host_experts.layers) == [1, 2]
    lx = plain.model.host_experts.layers[1]
    expert_mib = 2 * lx.bytes_per_expert * lx.gate.raw.shape[0] / 2**20
    trace = tmp_path / "lead.trace"
    cached = load_model(path, n_ctx=128, cache=CacheSettings(mib=expert_mib * 0.4, cpu_share=0.5, trace=trace))

    def greedy(lm: LoadedModel) -> list[int]:
        ev = generate(lm.model, lm.tokenizer, lm.tokenizer.encode(PROMPT)[:12], lm.new_cache(), max_tokens=24,
                      params=GREEDY, ignore_eos=True)  # fmt: skip
        return [e.token for e in ev if isinstance(e, TokenEvent) and e.token >= 0]

    assert greedy(plain) == greedy(cached)
    assert cached.cache is not None
    snap = cached.cache.snapshot()
    assert [layer.layer for layer in snap.layers] == [1, 2]
    assert sum(layer.small.lookups for layer in snap.layers) > 0
    assert len(cached.model.routing()) == 2
    cached.close()
    tr = read_trace(trace)
    assert {rec.layer for rec in tr} == {1, 2, -1 - 2} and tr.header["groups"][0]["layers"] == [1, 2]  # -3: layer 2's
    # prediction, made at layer 1 (one MoE layer ahead of another: the dense layer 0 predicts nothing)


def test_glm_nextn_blocks_are_neither_run_nor_loaded_and_inspect_counts_layers_by_kind(tmp_path: Path) -> None:
    from moechat.app.inspect_cmd import summary_rows

    path = tiny_moe(tmp_path / "glm.gguf", arch="glm4moe", n_layers=3, expert_type=Q.Q8_0)
    lm = load_model(path, n_ctx=64)
    assert lm.config.n_layers == 3 and lm.config.n_layers_skipped == 1 and len(lm.model.blocks) == 3
    assert "blk.3.nextn.eh_proj.weight" in lm.gguf.tensors
    assert sorted(lm.model.host_experts.layers) == [1, 2]  # layer 0 is dense, block 3 is NextN
    assert len(lm.new_cache().layers) == 3  # KV only for the decoder's layers
    rows = dict(summary_rows(lm.gguf, lm.config))
    assert rows["layers"] == "3: 3 full attention, 1 dense FFN, 2 MoE, 1 NextN skipped"
    one = lm.model.host_experts.layers[1].bytes_per_expert
    assert rows["expert bytes"].endswith(f"{one / 2**20:,.1f} MiB per expert")
    total = 2 * 8 * one  # two MoE layers of 8 experts: the NextN block's experts are not counted
    assert rows["expert bytes"].startswith(f"{total / 2**20:,.1f} MiB total")
    kv = 3 * lm.config.n_head_kv[0] * 2 * lm.config.head_dim * 4
    assert rows["KV cache (float32)"].startswith(f"{kv / 2**10:,.1f} KiB per token")


def test_latent_attention_caches_the_latent_only_and_inspect_says_so(tmp_path: Path) -> None:
    from moechat.app.inspect_cmd import summary_rows
    from testkit.ggufgen import MLA

    path = tiny_moe(tmp_path / "ds.gguf", arch="deepseek2", n_layers=3, expert_type=Q.Q8_0)
    lm = load_model(path, n_ctx=64)
    per_pos = MLA["kv_lora"] + MLA["rope"]  # one latent head, whatever the number of attention heads
    cache = lm.new_cache()
    for layer in cache.layers:
        assert layer.k.shape == (64, 1, per_pos)
        assert layer.v.untyped_storage().data_ptr() == layer.k.untyped_storage().data_ptr()  # value = latent
    ids = lm.tokenizer.encode("one two three four")
    with torch.inference_mode():
        lm.model(torch.tensor(ids), 0, cache)
    n = len(ids)
    assert bool(cache.layers[1].k[:n].abs().sum(-1).gt(0).all()) and not bool(cache.layers[1].k[n:].any())
    rows = dict(summary_rows(lm.gguf, lm.config))
    assert rows["layers"] == "3: 3 latent attention, 1 dense FFN, 2 MoE"
    assert rows["KV cache (float32)"].startswith(f"{3 * per_pos * 4 / 2**10:,.1f} KiB per token")
    assert f"latent {MLA['kv_lora']} + rotary key {MLA['rope']}" in rows["attention heads"]


def test_latent_attention_reads_files_with_the_joint_kv_b_matrix(tmp_path: Path) -> None:
    """Older DeepSeek files hold attn_kv_b (and per-head lengths) instead of attn_k_b/attn_v_b: same model."""
    split = load_model(tiny_moe(tmp_path / "split.gguf", arch="deepseek2", expert_type=Q.F32), n_ctx=64)
    joint = load_model(tiny_moe(tmp_path / "joint.gguf", arch="deepseek2", expert_type=Q.F32, mla_joint_kv_b=True),
                       n_ctx=64)  # fmt: skip
    assert "blk.0.attn_kv_b.weight" in joint.gguf.tensors and "blk.0.attn_k_b.weight" not in joint.gguf.tensors
    assert joint.config.head_dim == split.config.head_dim and joint.config.head_dim_mla == split.config.head_dim_mla
    ids = split.tokenizer.encode("one two three four five")
    with torch.inference_mode():
        a = split.model(torch.tensor(ids), 0, split.new_cache())
        b = joint.model(torch.tensor(ids), 0, joint.new_cache())
    assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_linear_attention_keeps_a_fixed_state_and_inspect_counts_full_attention_kv_only(tmp_path: Path,
                                                                                        arch: str) -> None:  # fmt: skip
    from moechat.app.inspect_cmd import summary_rows
    from testkit.ggufgen import DELTA

    path = tiny_moe(tmp_path / "h.gguf", arch=arch, n_layers=4, expert_type=Q.Q8_0)
    lm = load_model(path, n_ctx=64)
    cfg = lm.config
    assert cfg.recurrent == (True, False, True, False) and len(lm.model.blocks) == 4
    if arch == "qwen35moe":  # its MTP block: in the file, neither run nor loaded, nor cached
        assert cfg.n_layers_skipped == 1 and "blk.4.nextn.eh_proj.weight" in lm.gguf.tensors
    assert sorted(lm.model.host_experts.layers) == [0, 1, 2, 3]
    cache = lm.new_cache()
    hk, hv, dk, dv, taps = (DELTA[k] for k in ("k_heads", "v_heads", "dk", "dv", "taps"))
    for i in (0, 2):  # linear attention: no positions, a state of fixed size
        layer = cache.layers[i]
        assert layer.k.numel() == 0 and layer.conv is not None and layer.state is not None
        assert layer.conv.shape == (taps - 1, 2 * hk * dk + hv * dv) and layer.state.shape == (hv, dk, dv)
    assert cache.layers[1].k.shape == (64, cfg.n_head_kv[1], cfg.head_dim) and cache.layers[1].state is None
    ids = lm.tokenizer.encode("one two three four five six")
    with torch.inference_mode():
        first = lm.model(torch.tensor(ids), 0, cache)
        state = cache.layers[0].state.clone()
        assert bool(state.abs().sum() > 0)
        lm.model(torch.tensor(ids[:1]), cache.pos, cache)
        assert not torch.equal(state, cache.layers[0].state)  # each token moves the state
        # A fresh cache starts from zero: the same prompt gives the same logits again.
        again = lm.model(torch.tensor(ids), 0, lm.new_cache())
    assert torch.equal(first, again)
    rows = dict(summary_rows(lm.gguf, cfg))
    nextn = ", 1 NextN skipped" if arch == "qwen35moe" else ""
    assert rows["layers"] == f"4: 2 full attention, 2 linear attention, 0 dense FFN, 4 MoE{nextn}"
    kv = 2 * cfg.n_head_kv[1] * 2 * cfg.head_dim * 4  # two full-attention layers, keys and values, float32
    assert rows["KV cache (float32)"].startswith(f"{kv / 2**10:,.1f} KiB per token")
    state_bytes = 2 * ((taps - 1) * (2 * hk * dk + hv * dv) + hv * dk * dv) * 4
    assert rows["linear attention state"].startswith(f"{state_bytes / 2**20:,.1f} MiB at any context")


def test_linear_attention_reads_files_with_the_joint_qkvz_matrix(tmp_path: Path) -> None:
    """The first Qwen3-Next files hold ssm_in (q|k|v|z per key head) instead of attn_qkv/attn_gate: same model."""
    split = load_model(tiny_moe(tmp_path / "split.gguf", arch="qwen3next", expert_type=Q.F32), n_ctx=64)
    joint = load_model(tiny_moe(tmp_path / "joint.gguf", arch="qwen3next", expert_type=Q.F32, legacy_ssm_in=True),
                       n_ctx=64)  # fmt: skip
    assert "blk.0.ssm_in.weight" in joint.gguf.tensors and "blk.0.attn_qkv.weight" not in joint.gguf.tensors
    ids = split.tokenizer.encode("one two three four five")
    with torch.inference_mode():
        a = split.model(torch.tensor(ids), 0, split.new_cache())
        b = joint.model(torch.tensor(ids), 0, joint.new_cache())
    assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, Q.BF16], ids=lambda t: t.name)
def test_embedding_rows_are_the_dequantizers(qtype: Q, tmp_path: Path) -> None:
    """A token's embedding row, looked up in the file's bytes (one compiled call where the kernels read
    the type, the dequantizer's ops where they do not: BF16), has the exact dequantizer's bits."""
    from moechat.engine.gguf.dequant import dequantize

    lm = load_model(tiny_moe(tmp_path / "m.gguf", ends_type=qtype), n_ctx=16)
    embed = lm.model.embed
    assert isinstance(embed, QuantRows)
    ids = torch.tensor([0, 7, 3, 1000, 7])
    got = embed[ids]
    want = dequantize(embed.raw[ids], qtype)
    assert got.shape == (5, lm.config.n_embd)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(got[1], got[2])
    lm.close()
