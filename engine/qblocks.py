"""GGUF block layouts decoded in compiled code (numba): one entry per quant type.

Each decoder reads one block where it lies (a row of the file's bytes, at a byte offset) and
writes its weights as float32 into a scratch buffer. The arithmetic is the reference
dequantizer's (`engine/quants.py`, which matches gguf-py bit for bit); under `fastmath` LLVM
may fuse a multiply and an add, so a weight can differ from the reference by one unit in the
last place. The kernels in `cpu_kernels.py` decode a group of `GROUP` weights of a row at a
time (one super-block, or eight 32-weight blocks) and take dot products with the activations.

`_BLOCK` is the registry, one decoder per type; a type that is not in it runs on the exact path
(dequantize with torch, then matmul).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from .jit import njit, overload, types

GROUP = 256  # weights decoded at a time: one super-block, or eight 32-weight blocks

# float16 -> float32 without a float16 type: the value is (1024 + mantissa) * 2^(exponent - 25),
# or mantissa * 2^-24 for subnormals; both products are exact in float32.
_F16_POW = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 32)], dtype=np.float32)
# MXFP4's E8M0 scale, halved because the code book below is doubled: 2^(e - 128), exact in float32.
_E8M0_HALF = np.array([np.ldexp(1.0, e - 128) for e in range(256)], dtype=np.float32)
_IQ4_NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


@njit
def _f16(b: np.ndarray, o: int) -> np.float32:
    h = np.int32(b[o]) | (np.int32(b[o + 1]) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m + (1024 if e else 0)) * _F16_POW[e]
    return -v if h & 0x8000 else v


@njit(inline="always")
def _i8(v: np.uint8) -> np.float32:
    """A byte read as a signed int8, as float32."""
    x = np.int32(v)
    return np.float32(x - 256 if x > 127 else x)


# -- 32-weight blocks ----------------------------------------------------------------------------
# Each decoder reads the block at byte o of row b and writes its weights to y[yo:]. Offsets, not
# slices: a slice in compiled code is an object with a reference count, paid for at every block.


@njit(inline="always")
def _q4_0(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    d = _f16(b, o)
    for j in range(16):
        q = np.int32(b[o + 2 + j])
        y[yo + j] = np.float32((q & 15) - 8) * d
        y[yo + 16 + j] = np.float32((q >> 4) - 8) * d


@njit(inline="always")
def _q4_1(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    d, m = _f16(b, o), _f16(b, o + 2)
    for j in range(16):
        q = np.int32(b[o + 4 + j])
        y[yo + j] = np.float32(q & 15) * d + m
        y[yo + 16 + j] = np.float32(q >> 4) * d + m


@njit(inline="always")
def _qh32(b: np.ndarray, o: int) -> np.int64:
    return np.int64(b[o]) | (np.int64(b[o + 1]) << 8) | (np.int64(b[o + 2]) << 16) | (np.int64(b[o + 3]) << 24)


@njit(inline="always")
def _q5_0(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    d = _f16(b, o)
    qh = _qh32(b, o + 2)
    for j in range(16):
        q = np.int32(b[o + 6 + j])
        lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
        hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
        y[yo + j] = np.float32(lo - 16) * d
        y[yo + 16 + j] = np.float32(hi - 16) * d


@njit(inline="always")
def _q5_1(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    d, m = _f16(b, o), _f16(b, o + 2)
    qh = _qh32(b, o + 4)
    for j in range(16):
        q = np.int32(b[o + 8 + j])
        lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
        hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
        y[yo + j] = np.float32(lo) * d + m
        y[yo + 16 + j] = np.float32(hi) * d + m


@njit(inline="always")
def _q8_0(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    d = _f16(b, o)
    for j in range(32):
        y[yo + j] = _i8(b[o + 2 + j]) * d


@njit(inline="always")
def _iq4_nl(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    d = _f16(b, o)
    for j in range(16):
        q = np.int32(b[o + 2 + j])
        y[yo + j] = d * _IQ4_NL[q & 15]
        y[yo + 16 + j] = d * _IQ4_NL[q >> 4]


@njit(inline="always")
def _mxfp4(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    d = _E8M0_HALF[b[o]]
    for j in range(16):
        q = np.int32(b[o + 1 + j])
        y[yo + j] = d * _MXFP4[q & 15]
        y[yo + 16 + j] = d * _MXFP4[q >> 4]


# -- 256-weight super-blocks ----------------------------------------------------------------------


@njit(inline="always")
def _k_scale(b: np.ndarray, s: int, i: int) -> tuple[np.float32, np.float32]:
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block i from the 12 packed bytes at s."""
    if i < 4:
        return np.float32(np.int32(b[s + i]) & 63), np.float32(np.int32(b[s + i + 4]) & 63)
    sc = (np.int32(b[s + i + 4]) & 15) | ((np.int32(b[s + i - 4]) >> 6) << 4)
    mn = (np.int32(b[s + i + 4]) >> 4) | ((np.int32(b[s + i]) >> 6) << 4)
    return np.float32(sc), np.float32(mn)


@njit(inline="always")
def _k_pair(b: np.ndarray, o: int, c: int) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """Q4_K/Q5_K block at o, weights 64c..64c+63: (scale, min) of the low 32, then of the high 32."""
    d, dmin = _f16(b, o), _f16(b, o + 2)
    sc0, m0 = _k_scale(b, o + 4, 2 * c)
    sc1, m1 = _k_scale(b, o + 4, 2 * c + 1)
    return d * sc0, dmin * m0, d * sc1, dmin * m1


@njit(inline="always")
def _q4_k(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    for c in range(4):
        d0, m0f, d1, m1f = _k_pair(b, o, c)
        qo, lo = o + 16 + 32 * c, yo + 64 * c
        for j in range(32):
            q = np.int32(b[qo + j])
            y[lo + j] = d0 * np.float32(q & 15) - m0f
            y[lo + 32 + j] = d1 * np.float32(q >> 4) - m1f


@njit(inline="always")
def _q5_k(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    for c in range(4):
        d0, m0f, d1, m1f = _k_pair(b, o, c)
        qo, lo = o + 48 + 32 * c, yo + 64 * c
        for j in range(32):
            q = np.int32(b[qo + j])
            h = np.int32(b[o + 16 + j]) >> (2 * c)
            y[lo + j] = d0 * np.float32((q & 15) | ((h & 1) << 4)) - m0f
            y[lo + 32 + j] = d1 * np.float32((q >> 4) | ((h & 2) << 3)) - m1f


@njit(inline="always")
def _q6_k(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    d = _f16(b, o + 208)
    for half in range(2):
        ql, qh, sc, out = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half, yo + 128 * half
        # Each (ql, ql+32, qh) byte triple holds one weight of each 32-weight quarter; a scale covers 16.
        for g in range(2):
            s0, s1 = d * _i8(b[sc + g]), d * _i8(b[sc + 2 + g])
            s2, s3 = d * _i8(b[sc + 4 + g]), d * _i8(b[sc + 6 + g])
            lq, hq, oq = ql + 16 * g, qh + 16 * g, out + 16 * g
            for j in range(16):
                lo, hi, h = np.int32(b[lq + j]), np.int32(b[lq + 32 + j]), np.int32(b[hq + j])
                y[oq + j] = s0 * np.float32(((lo & 15) | ((h & 3) << 4)) - 32)
                y[oq + 32 + j] = s1 * np.float32(((hi & 15) | ((h & 12) << 2)) - 32)
                y[oq + 64 + j] = s2 * np.float32(((lo >> 4) | (h & 48)) - 32)
                y[oq + 96 + j] = s3 * np.float32(((hi >> 4) | ((h & 192) >> 2)) - 32)


@njit(inline="always")
def _iq4_xs(b: np.ndarray, o: int, y: np.ndarray, yo: int) -> None:
    d = _f16(b, o)
    sh = np.int32(b[o + 2]) | (np.int32(b[o + 3]) << 8)
    for ib in range(8):
        low = (np.int32(b[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 15
        ls = low | (((sh >> (2 * ib)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        qo, out = o + 8 + 16 * ib, yo + 32 * ib
        for j in range(16):
            q = np.int32(b[qo + j])
            y[out + j] = dl * _IQ4_NL[q & 15]
            y[out + 16 + j] = dl * _IQ4_NL[q >> 4]


# The registry: one entry per quant type, its block decoder.
_BLOCK = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.IQ4_NL: _iq4_nl,
    Q.MXFP4: _mxfp4, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.IQ4_XS: _iq4_xs,
}  # fmt: skip
DECODERS: dict[Q, tuple[int, int]] = {t: GGML_QUANT_SIZES[t] for t in _BLOCK}


def has_kernel(qtype: Q) -> bool:
    return qtype in DECODERS


def decode_group(code: int, row: np.ndarray, g: int, k: int, y: np.ndarray) -> int:
    """Weights g*GROUP .. of a row of k weights into y; returns how many (GROUP, fewer at a row's end).

    Compiled code only (see the overload below). `code`, the type's gguf enum value, must be a
    compile-time constant: a kernel closes over it, and only that type's decoder is compiled in.
    """
    raise NotImplementedError("decode_group runs in compiled code")


@overload(decode_group, inline="always")
def _decode_group(code, row, g, k, y):  # numba compares this signature with the impl's: no annotations
    if not isinstance(code, types.IntegerLiteral):
        return None  # numba retries with the constant's literal type
    qtype = Q(code.literal_value)
    block = _BLOCK[qtype]
    per_block, size = GGML_QUANT_SIZES[qtype]
    if per_block == GROUP:

        def one(code, row, g, k, y):
            block(row, g * size, y, 0)
            return GROUP

        return one

    def several(code, row, g, k, y):
        n = min(GROUP, k - g * GROUP)
        b0 = g * (GROUP // per_block)
        for i in range(n // per_block):
            block(row, (b0 + i) * size, y, per_block * i)
        return n

    return several
