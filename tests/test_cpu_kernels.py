"""The CPU kernels that read GGUF blocks in place, against gguf-py's dequantizer and the exact path.

Stated bounds, relative error (max |error| / max |reference|) for every type, shape and token
count: <= 1e-4 with the activations rounded to int16 with one scale per 256 (per 32 in rows whose
length is not a multiple of 256; measured 1e-5 to 4e-5 on Gaussian activations,
up to 1.3e-4 with large outliers), <= 1e-2 rounded to int8 (one scale per 32 for 32-weight blocks,
per 256 for super-blocks as llama.cpp's Q8_K; measured 2e-3 to 9e-3; up to 2.9e-2 with large
outliers, whose 256 then share one coarse scale); products accumulate in float32. A MoE layer
chains two products, the second on heavy-tailed activations: <= 2e-4 (int16; measured up to
1.2e-4), <= 4e-2 (int8; measured up to 2.9e-2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from moechat.engine.kernels import cpu as cpu_kernels
from moechat.engine.kernels import isa
from moechat.engine.kernels.codes import GEMM_TOKENS
from moechat.engine.kernels.qblocks import LAYOUTS
from moechat.engine.kernels.qtiles import TILE_TOKENS
from moechat.engine.models.gemma3 import gelu_gate
from moechat.engine.models.gpt_oss import oai_swiglu
from moechat.engine.moe.expert_tensors import ExpertTensor, LayerExperts
from moechat.engine.moe.host_experts import run_experts, sum_parts
from moechat.engine.moe.kernel_calls import run_fused
from moechat.engine.nn.activations import swiglu
from moechat.engine.nn.qlinear import QLinear, set_activation_bits
from testkit.ggufgen import Q, quantized

BOUND = {16: 1e-4, 8: 1e-2}  # by the activations' bits
OUTLIER_BOUND = {16: 2e-4, 8: 4e-2}  # every 97th activation 50 times the rest: the rounding of its group grows
MOE_BOUND = {16: 2e-4, 8: 4e-2}
TILES8_BOUND = 1e-5  # int8 tiles against the rows' int8 dot products (kernels.qtiles8)
# A prompt's int8 tiles over a super-block type against the float GEMM: Q4_K, 200 random prompts of 40
# tokens, median 7.2e-3, largest 1.14e-2 (8 of them over 1e-2: the 256 share one coarse scale).
PROMPT8_BOUND = 1.5e-2
TYPES = sorted(LAYOUTS, key=lambda t: t.name)


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def _shape(qtype: Q) -> tuple[int, int]:
    """Rows not a multiple of the kernels' row tiles; for 32-weight blocks, a row that ends mid-group, of an odd
    number of blocks (the kernels take them two at a time); MXFP4's 19 blocks: four at a time on AVX-512,
    then two, then one."""
    per_block = GGML_QUANT_SIZES[qtype][0]
    return 37, (3 * 256 if per_block == 256 else 2 * 256 + (3 if qtype == Q.MXFP4 else 1) * 32)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dense_kernel_matches_gguf_py(qtype: Q, bits: int) -> None:
    rng = np.random.default_rng(int(qtype))
    n, k = _shape(qtype)
    raw = quantized((n, k), qtype, rng)
    w = gguf_dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    for t in (1, 2, 8, 33):
        x = rng.standard_normal((t, k)).astype(np.float32)
        got = cpu_kernels.dense(raw, qtype, x, bits)
        assert got.shape == (t, n)
        assert _rel(got, x.astype(np.float64) @ w.T) <= BOUND[bits], t
        # Four tokens share each pass over a row, the rest go one by one: a token's result is the same
        # (int8's tiles, with VNNI: the same integers, float sums in another order).
        alone = np.concatenate([cpu_kernels.dense(raw, qtype, x[i : i + 1], bits) for i in range(t)])
        if t >= TILE_TOKENS and cpu_kernels.tiles_read(qtype, k, bits) and bits == 8:
            assert _rel(got, alone) <= TILES8_BOUND, t
        else:
            np.testing.assert_array_equal(got, alone)
    if bits == 8:
        return
    decoded = cpu_kernels.dequantize_rows(raw, qtype, k)
    np.testing.assert_allclose(decoded, w, rtol=1e-6, atol=1e-7 * np.abs(w).max())


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dense_kernel_bound_holds_with_outliers(qtype: Q, bits: int) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    raw = quantized((48, 2048), qtype, rng)
    w = gguf_dequantize(raw, qtype).reshape(48, 2048).astype(np.float64)
    x = rng.standard_normal((3, 2048)).astype(np.float32)
    x[:, ::97] *= 50
    assert _rel(cpu_kernels.dense(raw, qtype, x, bits), x.astype(np.float64) @ w.T) <= OUTLIER_BOUND[bits]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_several_matrices_in_one_call_equal_one_at_a_time(qtype: Q) -> None:
    """q, k and v in one call (rows of each not a multiple of the row tiles) == each alone, bit for bit."""
    rng = np.random.default_rng(5)
    ws = [quantized((n, 512), qtype, rng) for n in (70, 18, 18)]
    for t in (1, 5):
        x = rng.standard_normal((t, 512)).astype(np.float32)
        outs = cpu_kernels.dense_many(tuple(ws), qtype, x)
        assert len(outs) == 3
        for w, out in zip(ws, outs, strict=True):
            np.testing.assert_array_equal(out, cpu_kernels.dense(w, qtype, x))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_qlinear_agrees_below_and_above_the_gemm_switch(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """Few tokens run the kernel; many run its integer tiles where they read the type (a
    super-block type: each token's very bits as alone), else a float GEMM over decoded tiles of
    rows: all the same product."""
    rng = np.random.default_rng(1)
    raw = quantized((300, 512), qtype, rng)
    lin = QLinear(raw, qtype)
    lin_tiles = QLinear(raw, qtype)  # another matrix object over the same bytes
    assert lin.tiled == (qtype == Q.Q4_K)
    # `--cpu-kernels int8` sets the bits after loading: its prompts take int8 tiles where the CPU has
    # VNNI and they read the type, else the float GEMM.
    holder, w8 = torch.nn.Module(), QLinear(raw, qtype)
    holder.w = w8
    set_activation_bits(holder, 8, 8)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1))
    assert w8.bits == 8 and w8.tiled == (qtype == Q.Q4_K and isa.VNNI)
    if w8.tiled:
        assert _rel(w8(x).numpy(), w8.gemm(x).double().numpy()) <= PROMPT8_BOUND
    else:
        assert torch.equal(w8(x), w8.gemm(x))
    # The default's widths where the CPU has byte products: a few tokens int8, a prompt int16's tiles.
    w816 = QLinear(raw, qtype, bits=8, prompt_bits=16)
    assert w816.tiled == lin.tiled and torch.equal(w816(x), lin(x))
    assert torch.equal(w816(x[:4]), w8(x[:4])) and not torch.equal(w816(x[:4]), lin(x[:4]))
    w = lin.dequantized().double()
    for t in (1, GEMM_TOKENS - 1, GEMM_TOKENS, 40):
        x = torch.randn(t, 512)
        got = lin(x)
        assert got.shape == (t, 300)
        assert _rel(got.numpy(), (x.double() @ w.T).numpy()) <= BOUND[16]
        if lin.tiled:
            assert all(torch.equal(got[i], lin(x[i : i + 1])[0]) for i in range(t))
    # Tiles smaller than the matrix (64 rows, the last one short): every row is still computed once.
    x = torch.randn(GEMM_TOKENS + 3, 512)
    whole = lin(x)
    monkeypatch.setattr("moechat.engine.nn.qlinear.GEMM_TILE_BYTES", 64 * 512 * 4 + 4)
    assert torch.allclose(lin_tiles(x), whole, rtol=1e-6, atol=1e-6)


def _experts(qtypes: tuple[Q, Q, Q], n_expert: int, e: int, f: int, rng: np.random.Generator,
             bias: bool = False) -> LayerExperts:  # fmt: skip
    def one(qtype: Q, rows: int, cols: int) -> ExpertTensor:
        raw = torch.from_numpy(quantized((n_expert, rows, cols), qtype, rng))
        b = torch.from_numpy(rng.standard_normal((n_expert, rows)).astype(np.float32) * 0.1) if bias else None
        return ExpertTensor(raw, qtype, b)

    return LayerExperts(one(qtypes[0], f, e), one(qtypes[1], f, e), one(qtypes[2], e, f))


MOE_CASES = [
    ((Q.Q4_K, Q.Q4_K, Q.Q6_K), swiglu, 0, False),
    ((Q.Q8_0, Q.Q8_0, Q.Q8_0), gelu_gate, 1, False),
    ((Q.MXFP4, Q.MXFP4, Q.MXFP4), oai_swiglu, 2, True),
    ((Q.IQ4_XS, Q.Q5_K, Q.Q4_0), swiglu, 0, False),
]


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize(("qtypes", "act", "code", "bias"), MOE_CASES, ids=lambda c: getattr(c, "__name__", None))
def test_fused_moe_matches_the_exact_path(qtypes: tuple[Q, Q, Q], act: object, code: int, bias: bool,
                                          bits: int) -> None:  # fmt: skip
    """All selected experts of a layer in three calls == one expert at a time, dequantized (within MOE_BOUND)."""
    rng = np.random.default_rng(7)
    n_expert, e, f, k = 6, 256, 512, 3
    lx = _experts(qtypes, n_expert, e, f, rng, bias)
    mats = (lx.gate.raw.numpy(), lx.up.raw.numpy(), lx.down.raw.numpy())
    for t in (1, 2, 8, 33):
        x = torch.randn(t, e)
        # Experts repeat across tokens, and expert 5 is never selected.
        ids = torch.stack([torch.from_numpy(rng.permutation(5)[:k]) for _ in range(t)])
        w = torch.rand(t, k)
        ref = sum_parts(x, run_experts(lx, x, ids, w, act, ids.unique().tolist()))
        contrib = np.full((t * k, e), np.nan, np.float32)
        chosen = sorted(set(ids.flatten().tolist()))
        run_fused(lx, mats, None, code, x.numpy(), ids.numpy(), w.numpy(), chosen, contrib, (bits, bits))
        assert not np.isnan(contrib).any()
        got = cpu_kernels.sum_by_token(contrib, ids.numpy())
        assert _rel(got, ref.double().numpy()) <= MOE_BOUND[bits], t


def test_fused_moe_parts_add_up_bit_for_bit() -> None:
    """Experts split over two calls (slots for some, the host copy for the rest) give the very same sums."""
    rng = np.random.default_rng(3)
    n_expert, e, f, k, t = 8, 256, 256, 4, 5
    lx = _experts((Q.Q4_K, Q.Q4_K, Q.Q6_K), n_expert, e, f, rng)
    mats = (lx.gate.raw.numpy(), lx.up.raw.numpy(), lx.down.raw.numpy())
    x = rng.standard_normal((t, e)).astype(np.float32)
    ids = np.stack([rng.permutation(n_expert)[:k] for _ in range(t)]).astype(np.int64)
    w = rng.random((t, k)).astype(np.float32)
    whole = np.empty((t * k, e), np.float32)
    run_fused(lx, mats, None, 0, x, ids, w, list(range(n_expert)), whole)
    # "Slots": the experts 0..3 copied into a bank in reverse order, as a cache would hold them.
    slot_of = np.full(n_expert, -1, np.int64)
    slot_of[[0, 1, 2, 3]] = [3, 2, 1, 0]
    bank = tuple(np.ascontiguousarray(m[[3, 2, 1, 0]]) for m in mats)
    parts = np.empty((t * k, e), np.float32)
    run_fused(lx, (bank[0], bank[1], bank[2]), slot_of, 0, x, ids, w, [0, 1, 2, 3], parts)
    run_fused(lx, mats, None, 0, x, ids, w, [4, 5, 6, 7], parts)
    assert np.array_equal(parts, whole)
    assert np.array_equal(cpu_kernels.sum_by_token(parts, ids), cpu_kernels.sum_by_token(whole, ids))


@pytest.mark.parametrize("bits", [16, 8])
def test_a_token_alone_equals_the_same_token_in_a_batch(bits: int) -> None:
    """A token or three write each row as it is made, more write a block at once (`_staged`): the same floats,
    biases, routing scales and the activation included. Q8_0 rows read no tiles: the same dot products."""
    rng = np.random.default_rng(11)
    n_expert, e, f, t = 3, 256, 96, 6
    gate, up, down = (np.stack([quantized(shape, Q.Q8_0, rng) for _ in range(n_expert)]) for shape in
                      ((f, e), (f, e), (e, f)))  # fmt: skip
    bg, bu, bd = (rng.standard_normal((n_expert, n)).astype(np.float32) for n in (f, f, e))
    x = rng.standard_normal((t, e)).astype(np.float32)
    scale = rng.random(t).astype(np.float32)
    sel = np.array([2], np.int64)

    def run(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = rows.size
        ptr, a = np.array([0, n], np.int64), np.arange(n, dtype=np.int64)
        h = np.empty((n, f), np.float32)
        cpu_kernels.gate_up(gate, Q.Q8_0, up, Q.Q8_0, x[rows], a, sel, sel, ptr, a, a, h, 0, bg, bu, bits=bits)
        y = np.empty((n, e), np.float32)
        cpu_kernels.matmul(down, Q.Q8_0, h, a, sel, sel, ptr, a, a, y, scale[rows], bd, bits=bits)
        return h, y

    h_all, y_all = run(np.arange(t))
    for i in range(t):
        h, y = run(np.array([i]))
        np.testing.assert_array_equal(h[0], h_all[i])
        np.testing.assert_array_equal(y[0], y_all[i])


def test_combine_sums_in_expert_order() -> None:
    """The sum per token does not depend on the order in which the router listed its experts."""
    rng = np.random.default_rng(5)
    contrib = (rng.standard_normal((6, 16)) * 10.0 ** rng.integers(-4, 4, (6, 1))).astype(np.float32)
    ids = np.array([[4, 1, 7], [0, 9, 3]], np.int64)
    swapped = np.array([[7, 4, 1], [3, 0, 9]], np.int64)
    perm = np.array([2, 0, 1, 5, 3, 4])  # the rows of each token, in the swapped listing's order
    a = cpu_kernels.sum_by_token(contrib, ids)
    b = cpu_kernels.sum_by_token(contrib[perm], swapped)
    assert np.array_equal(a, b)
    assert np.allclose(a, contrib.reshape(2, 3, 16).sum(1), rtol=1e-6, atol=1e-6)


def test_selection_groups_the_chosen_pairs_by_expert() -> None:
    rng = np.random.default_rng(11)
    ids = np.stack([rng.permutation(9)[:3] for _ in range(7)]).astype(np.int64)  # [T=7, k=3]
    for chosen in (np.zeros(0, np.int64), np.array([8, 2, 5], np.int64), np.array([40], np.int64)):
        a, eids, ptr, a_in, x_rows = cpu_kernels.selection(ids, chosen)
        flat = ids.reshape(-1)
        keep = np.flatnonzero(np.isin(flat, chosen)) if chosen.size else np.arange(flat.size)
        ref = keep[np.argsort(flat[keep], kind="stable")]
        np.testing.assert_array_equal(a, ref)
        np.testing.assert_array_equal(eids, np.unique(flat[keep]))
        np.testing.assert_array_equal(flat[a], np.repeat(eids, np.diff(ptr)))
        np.testing.assert_array_equal(a_in, ref // 3)
        np.testing.assert_array_equal(x_rows, np.unique(ref // 3))
