"""One registry of quant types (engine/gguf/quant_types.py): every path it claims for a type decodes
that type as gguf-py's reference does, and each path implements exactly the types claimed for it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import quants as reference
from moechat.engine.gguf import codebooks, dequant
from moechat.engine.gguf.quant_types import CPU, DEVICE, PATHS, REGISTRY, TORCH, types_for
from moechat.engine.kernels import device, qblocks
from moechat.engine.kernels.codes import GEMM_TOKENS
from moechat.engine.kernels.cpu import dequantize_rows
from testkit.ggufgen import Q, quantized

CLAIMS = [(t, path) for t, entry in sorted(REGISTRY.items()) for path in sorted(entry.paths)]
# Decoding to float32 (a scale times an integer) rounds once; the kernels may fuse it differently.
BOUND = 1e-6  # of the largest weight


def _reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    return reference.dequantize(raw, qtype).astype(np.float32)


def _blocks(qtype: Q, cols: int) -> np.ndarray:
    """5 rows of `cols` weights in `qtype`, as bytes [5, row_bytes], every scale finite."""
    rng = np.random.default_rng(int(qtype))
    if qtype == Q.BF16:  # bfloat16: the high half of a float32
        x = (rng.standard_normal((5, cols)) * 0.05).astype(np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(5, -1)
    return quantized((5, cols), qtype, rng).view(np.uint8).reshape(5, -1)


def _decode(path: str, raw: np.ndarray, qtype: Q, cols: int) -> np.ndarray:
    if path == TORCH:
        return dequant.dequantize(torch.from_numpy(raw.copy()), qtype).reshape(raw.shape[0], cols).numpy()
    if path == CPU:
        return dequantize_rows(raw, qtype, cols)
    if not device.available():
        pytest.skip("triton is not installed")
    # The device's dense product with the identity decodes the matrix (transposed), in Triton (its
    # interpreter where there is no GPU); enough tokens that it decodes the tile once and multiplies.
    eye = torch.eye(cols, dtype=torch.float32)
    return device.dense(torch.from_numpy(raw.copy()), qtype, eye).T.contiguous().numpy()


@pytest.mark.parametrize(("qtype", "path"), CLAIMS, ids=lambda v: getattr(v, "name", v))
def test_every_claimed_path_decodes_as_gguf_py(qtype: Q, path: str) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    cols = 2 * max(block, 32) if block > 1 else 64
    if path == DEVICE:
        cols = max(cols, GEMM_TOKENS)
    raw = _blocks(qtype, cols)
    ref = _reference(raw, qtype)
    got = _decode(path, raw, qtype, cols)
    assert got.shape == ref.shape == (5, cols)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    if path == TORCH:
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))  # bit-exact
    else:
        assert np.abs(got - ref).max() <= BOUND * np.abs(ref).max()


def test_each_path_implements_exactly_its_claimed_types() -> None:
    assert dequant.supported_types() == types_for(TORCH)
    assert set(qblocks.LAYOUTS) == types_for(CPU)
    assert types_for(DEVICE) == device.TYPES
    assert all(entry.paths <= set(PATHS) and TORCH in entry.paths for entry in REGISTRY.values())
    assert all((t in qblocks.LAYOUTS) == (CPU in e.paths) for t, e in REGISTRY.items())


def test_the_code_books_are_gguf_pys() -> None:
    assert tuple(reference.IQ4_NL.kvalues) == codebooks.IQ4_NL_VALUES
    assert tuple(reference.MXFP4.kvalues) == codebooks.MXFP4_VALUES  # e2m1, doubled to integers


def test_a_wrong_decoder_is_caught() -> None:
    """The comparison can fail: a decoder off by one code step disagrees."""
    raw = _blocks(Q.Q8_0, 64).copy()
    ref = _reference(raw, Q.Q8_0)
    raw[:, 2] += 1  # the first weight of each row's first block, one step up
    got = dequantize_rows(raw, Q.Q8_0, 64)
    assert np.abs(got - ref).max() > BOUND * np.abs(ref).max()
