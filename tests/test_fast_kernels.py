"""The opt-in int4 CPU kernel path (--cpu-kernels int4): exact codes, bounded error, same cache invariance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from moechat.engine.expert_cache import CacheSettings
from moechat.engine.fast_kernels import Int4Linear, packed_nbytes, planes_for
from moechat.engine.layers import QuantRows
from moechat.engine.loader import load_model
from moechat.engine.quants import CODE_GROUP_TYPES, code_groups, dequantize
from testkit.ggufgen import Q, random_blocks, tiny_moe

BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q8_0: 8, Q.IQ4_NL: 8, Q.IQ4_XS: 8,
        Q.MXFP4: 5, Q.Q3_K: 9, Q.Q6_K: 13}  # fmt: skip  # signed bits of the codes code_groups gives


@pytest.mark.parametrize("qtype", sorted(CODE_GROUP_TYPES))
def test_codes_are_exact_and_the_kernel_error_is_bf16_sized(qtype: Q) -> None:
    rng = np.random.default_rng(1)
    block, size = GGML_QUANT_SIZES[qtype]
    n, k = 256, 1024
    raw = torch.from_numpy(random_blocks(qtype, n * k // block, rng).reshape(n, k // block * size))
    w = dequantize(raw, qtype)
    q, scale, minv = code_groups(raw, qtype)
    assert -(2 ** (BITS[qtype] - 1)) <= int(q.min()) and int(q.max()) < 2 ** BITS[qtype]
    # The codes and per-32 maps give back the reference dequantizer's values bit for bit.
    assert torch.equal(scale.repeat_interleave(32, 1) * q.float() - minv.repeat_interleave(32, 1), w)
    lin = Int4Linear(raw, qtype)
    assert lin.planes <= planes_for(qtype)
    assert lin.nbytes <= packed_nbytes(qtype, n * k)
    x = torch.randn(5, k)
    ref = x @ w.T
    got = lin(x)
    # bf16 activations and scales: about 3 significant digits (measured 0.23 to 0.48%).
    assert float((got - ref).norm() / ref.norm()) < 0.01


def test_q2_k_has_no_per_32_form() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q2_K, 4, np.random.default_rng(0)).reshape(1, -1))
    with pytest.raises(ValueError, match="Q2_K"):
        code_groups(raw, Q.Q2_K)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q6_K])
def test_int4_path_keeps_the_cache_invariance_and_stays_close(tmp_path: Path, qtype: Q) -> None:
    path = tiny_moe(tmp_path / "m.gguf", n_layers=2, n_expert=8, n_expert_used=2, expert_type=qtype, logit_scale=4.0)
    ids = torch.tensor(load_model(path, n_ctx=64).tokenizer.encode("The river rose in the spring and")[:12])

    def logits(**kw: object) -> torch.Tensor:
        lm = load_model(path, n_ctx=64, **kw)
        kv = lm.new_cache()
        with torch.inference_mode():
            return torch.cat([lm.model(ids[i : i + 1], i, kv) for i in range(len(ids))])

    exact = logits()
    fast = logits(cpu_kernels="int4")
    cached = logits(cpu_kernels="int4", cache=CacheSettings(mib=0.5, cpu_share=0.5))
    assert torch.equal(fast, cached)  # on the CPU device the cache still changes nothing
    assert not torch.equal(fast, exact)  # the fast path did run
    assert float((fast - exact).norm() / exact.norm()) < 0.02
    assert float((fast.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.9
    with pytest.raises(ValueError, match="cpu-kernels"):
        load_model(path, n_ctx=64, cpu_kernels="int2")


def test_packing_in_row_chunks_gives_the_same_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    # Large matrices (a 262k-row vocabulary) are packed a chunk of rows at a time.
    rng = np.random.default_rng(2)
    raw = torch.from_numpy(random_blocks(Q.Q8_0, 96 * 256 // 32, rng).reshape(96, -1))
    whole = Int4Linear(raw, Q.Q8_0)
    monkeypatch.setattr(Int4Linear, "CHUNK", 64)  # two chunks: a whole block of 64 rows and a tail of 32
    chunked = Int4Linear(raw, Q.Q8_0)
    assert torch.equal(chunked.packed, whole.packed) and torch.equal(chunked.scales_zeros, whole.scales_zeros)
    assert (chunked.n, chunked.k) == (96, 256)
    x = torch.randn(3, 256)
    assert torch.equal(chunked(x), whole(x))


@pytest.mark.parametrize("tied", [False, True])
def test_int4_packs_the_output_projection_and_reads_embedding_rows(tmp_path: Path, tied: bool) -> None:
    # 1021 ranked tokens + 3 specials = 1024 rows: the kernel packs rows in 16s.
    path = tiny_moe(tmp_path / "m.gguf", n_layers=2, n_vocab=1021, ends_type=Q.Q8_0, tied=tied)
    exact = load_model(path, n_ctx=64)
    fast = load_model(path, n_ctx=64, cpu_kernels="int4")
    assert exact.model.head_kernel is None and isinstance(exact.model.output, torch.Tensor)
    assert fast.model.head_kernel is not None
    assert isinstance(fast.model.embed, QuantRows) and (fast.model.output is fast.model.embed) == tied
    ids = torch.tensor(exact.tokenizer.encode("The river rose in the spring and")[:10])
    # The embedding rows read from the file are the dequantized ones, bit for bit.
    assert torch.equal(fast.model.embed[ids], exact.model.embed[ids])
    with torch.inference_mode():
        a = exact.model(ids, 0, exact.new_cache())
        b = fast.model(ids, 0, fast.new_cache())
    assert a.shape == b.shape
    assert float((b - a).norm() / a.norm()) < 0.02
