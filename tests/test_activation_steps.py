"""The steps around a decode layer's products: activations quantized for the dot products, the RMS
norm's sum of squares, the rows' blocks asked for ahead. The first two have a vector form (rows whose
elements lie together) and a loop form (any layout); the two must give the same bits, and the vector
form must be the one C-ordered rows take."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from moechat.engine.kernels.jit import njit
from moechat.engine.kernels.layer_halves import rms_rows
from moechat.engine.kernels.qblocks import (
    ACT8,
    ACT16,
    LANES,
    SUPER,
    dot_row,
    quantize_rows,
    sum_squares,
)
from testkit.ggufgen import Q, quantized


@njit(fastmath=False)
def _quantized8(x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return quantize_rows(x, rows, 8)


@njit(fastmath=False)
def _quantized16(x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return quantize_rows(x, rows, 16)


@njit(fastmath=False)
def _squares(x: np.ndarray, row: int) -> float:
    return sum_squares(x, row, x.shape[1])


def _rows(rng: np.random.Generator, r: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The same values as a C-ordered array and as every other column of a wider one (numba's 'A'
    layout: the loops)."""
    x = (rng.standard_normal((r, k)) * rng.choice([1e-3, 1.0, 40.0], (r, k))).astype(np.float32)
    x[0, :LANES] = 0  # a group of zeros: scale 0, integers 0
    wide = np.zeros((r, 2 * k), np.float32)
    wide[:, ::2] = x
    return x, wide[:, ::2]


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize(("r", "k"), [(1, 2048), (8, 768), (3, 96), (2, 2880), (5, 512)])
def test_quantized_activations_vectors_and_loops_agree(bits: int, r: int, k: int) -> None:
    """Bit for bit, with groups of 32 and of 256 (int8 holds both where K allows), and within half a step
    of the activation they stand for."""
    rng = np.random.default_rng(bits * k + r)
    c, a = _rows(rng, r, k)
    rows = np.arange(r)
    fn = _quantized8 if bits == 8 else _quantized16
    got, ref = fn(c, rows), fn(a, rows)
    for g, w in zip(got, ref, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8))
    xq, dx, _ = got
    top = ACT8 if bits == 8 else ACT16
    assert np.abs(xq[:, :k]).max() == top  # each group's largest magnitude maps to the top integer
    step = np.repeat(dx[:, : k // LANES], LANES, axis=1).astype(np.float64)
    # half a step, and the float32 rounding of x times the inverse step (a few units in the last place of x)
    assert np.all(np.abs(xq[:, :k] * step - c) <= 0.5 * step + 3e-7 * np.abs(c))
    if bits == 8 and k % SUPER == 0:  # the second copy: one scale per 256
        assert np.all(np.ptp(dx[:, k // LANES :].reshape(r, -1, SUPER // LANES), axis=2) == 0)


def test_c_ordered_rows_take_the_vector_steps() -> None:
    """A layout change that fell back to the loops would keep the bits and lose the speed: the compiled
    code must hold the vector rounding and the lane-wise sums. The callers are compiled here, never
    loaded from numba's disk cache, whose code cannot be inspected."""
    rng = np.random.default_rng(0)
    c, a = _rows(rng, 2, 512)
    rows = np.arange(2)
    quantized8 = njit(fastmath=False, cache=False)(_quantized8.py_func)
    squares = njit(fastmath=False, cache=False)(_squares.py_func)
    for x in (c, a):
        quantized8(x, rows)
        squares(x, 0)
    by_layout = {sig[0].layout: ir for sig, ir in quantized8.inspect_llvm().items()}
    assert "llvm.rint.v32f32" in by_layout["C"] and "llvm.rint.v32f32" not in by_layout["A"]
    by_layout = {sig[0].layout: ir for sig, ir in squares.inspect_llvm().items()}
    assert "llvm.fma.v32f32" in by_layout["C"] and "llvm.fma.v32f32" not in by_layout["A"]


@pytest.mark.parametrize("k", [2048, 64, 36, 2880, 100])
def test_sum_of_squares_and_rms_against_float64(k: int) -> None:
    """In vectors (whole 32s, then the rest one by one) and in the loop, within float32's rounding of a sum."""
    rng = np.random.default_rng(k)
    c, a = _rows(rng, 3, k)
    want = (c.astype(np.float64) ** 2).sum(axis=1)
    for x in (c, a):
        got = np.array([_squares(x, r) for r in range(3)])
        assert np.all(np.abs(got - want) <= 1e-6 * k * want + 1e-30)
    w = rng.standard_normal(k).astype(np.float32)
    ref = c.astype(np.float64) / np.sqrt((c.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    assert np.abs(rms_rows(c, w, 1e-6) - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.MXFP4])
def test_row_products_ask_for_their_blocks_ahead(qtype: Q) -> None:
    """The products of a row ask for its blocks PREFETCH_AHEAD bytes before reading them (a super-block
    type, a 32-weight type, MXFP4's four blocks a pass on AVX-512): without it a server core read the
    rows at two thirds of the speed. The prefetch changes no value, so only the compiled code shows it."""
    code = int(qtype)

    @njit(fastmath=False, cache=False)
    def row(w: np.ndarray, xq: np.ndarray, dx: np.ndarray, bs: np.ndarray) -> float:
        return dot_row(code, w, 0, 512, xq, dx, bs, 0)

    rng = np.random.default_rng(0)
    w = quantized((1, 512), qtype, rng).view(np.uint8).reshape(1, -1)
    x = rng.standard_normal((1, 512)).astype(np.float32)
    xq, dx, bs = _quantized8(x, np.arange(1))
    got = row(w, xq, dx, bs)
    weights = gguf_dequantize(w, qtype).reshape(-1).astype(np.float64)
    want = float(weights @ x[0].astype(np.float64))
    assert abs(got - want) <= 1e-2 * np.abs(x).sum() * np.abs(weights).max()
    ir_text = next(iter(row.inspect_llvm().values()))
    assert ir_text.count("@llvm.prefetch") >= 2  # the declaration and at least one call
