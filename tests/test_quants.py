"""Every dequantizer is bit-exact with gguf-py's reference, on random blocks and edge values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from hypothesis import given, settings
from hypothesis import strategies as st
from moechat.engine.gguf import dequant as mq
from moechat.engine.gguf.reader import GGUFFile
from testkit.ggufgen import Q

REQUIRED = [
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K,
    Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4,
]  # fmt: skip


def _reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    with np.errstate(all="ignore"):
        return quants.dequantize(raw, qtype)


def assert_bit_exact(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape and got.dtype == np.float32
    nan_got, nan_ref = np.isnan(got), np.isnan(ref)
    assert np.array_equal(nan_got, nan_ref), "NaN positions differ"
    # Compare bits, so -0.0 vs 0.0 and every last ulp count.
    assert np.array_equal(np.where(nan_got, 0, got).view(np.uint32), np.where(nan_ref, 0, ref).view(np.uint32))


def test_registry_covers_the_required_types() -> None:
    assert set(REQUIRED) <= mq.supported_types()


@pytest.mark.parametrize("qtype", REQUIRED, ids=lambda q: q.name)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_bit_exact_on_random_blocks(qtype: Q, data: st.DataObject) -> None:
    _, size = GGML_QUANT_SIZES[qtype]
    rows = data.draw(st.integers(1, 3))
    blocks = data.draw(st.integers(1, 4))
    raw_bytes = data.draw(st.binary(min_size=rows * blocks * size, max_size=rows * blocks * size))
    raw = np.frombuffer(raw_bytes, dtype=np.uint8).reshape(rows, blocks * size).copy()
    got = mq.dequantize(torch.from_numpy(raw.copy()), qtype).numpy()
    assert_bit_exact(got, _reference(raw, qtype))


def test_mxfp4_every_exponent() -> None:
    raw = np.zeros((256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = np.arange(16, dtype=np.uint8) * 0x11  # every code in both nibbles
    got = mq.dequantize(torch.from_numpy(raw.copy()), Q.MXFP4).numpy()
    ref = _reference(raw, Q.MXFP4)
    assert_bit_exact(got, ref)
    # Exponent 127 with code 2 (1.0 doubled) is exactly 1.0; ggml's scale for 255 is 2^127, not NaN.
    assert got[127, 2] == 1.0
    assert got[255, 1] == 2.0**127 and np.isinf(got[255, 2])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS, Q.Q3_K, Q.Q2_K], ids=lambda q: q.name)
@pytest.mark.parametrize("scale", [np.inf, -np.inf, np.nan, 0.0, -0.0, 65504.0, 6e-8])
def test_edge_scales(qtype: Q, scale: float) -> None:
    from testkit.ggufgen import F16_SCALES

    rng = np.random.default_rng(1)
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(4, size), dtype=np.uint8)
    for at in F16_SCALES[qtype]:
        raw[:, at : at + 2] = np.array([scale], dtype=np.float16).view(np.uint8)
    got = mq.dequantize(torch.from_numpy(raw.copy()), qtype).numpy()
    assert_bit_exact(got, _reference(raw, qtype))


def test_dequantize_a_file_tensor(tiny_model: Path) -> None:
    with GGUFFile(tiny_model) as f:
        t = f["blk.0.ffn_down_exps.weight"]
        raw = f.tensor_data(t.name)
        w = mq.dequantize(raw[3], t.qtype)  # one expert, straight from the map
        assert w.shape == t.shape[1:] == (256, 256)
        assert_bit_exact(w.numpy(), _reference(np.asarray(raw[3]), t.qtype))
        assert 0 < float(w.abs().mean()) < 1


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="not a whole number"):
        mq.dequantize(torch.zeros(2, 35, dtype=torch.uint8), Q.Q8_0)
    with pytest.raises(TypeError):
        mq.dequantize(torch.zeros(2, 34, dtype=torch.int8), Q.Q8_0)
    with pytest.raises(NotImplementedError, match="IQ2_XXS"):
        mq.dequantize(torch.zeros(1, 66, dtype=torch.uint8), Q.IQ2_XXS)
