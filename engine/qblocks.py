"""GGUF block layouts decoded in compiled code (numba): one entry per quant type.

Each decoder reads one block where it lies (a row of the file's bytes, at a byte offset) and
writes its weights as float32 into a scratch buffer. The arithmetic is the reference
dequantizer's (`engine/quants.py`, which matches gguf-py bit for bit); under `fastmath` LLVM
may fuse a multiply and an add, so a weight can differ from the reference by one unit in the
last place. The kernels in `cpu_kernels.py` decode a group of `GROUP` weights of a row at a
time (one super-block, or eight 32-weight blocks) and take dot products with the activations.

`DECODERS` is the registry, one entry per type; a type that is not in it runs on the exact
path (dequantize with torch, then matmul).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from .jit import njit

GROUP = 256  # weights decoded at a time: one super-block, or eight 32-weight blocks

# float16 -> float32 without a float16 type: the value is (1024 + mantissa) * 2^(exponent - 25),
# or mantissa * 2^-24 for subnormals; both products are exact in float32.
_F16_POW = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 32)], dtype=np.float32)
# MXFP4's E8M0 scale, halved because the code book below is doubled: 2^(e - 128), exact in float32.
_E8M0_HALF = np.array([np.ldexp(1.0, e - 128) for e in range(256)], dtype=np.float32)
_IQ4_NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)
_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


@njit(inline="always")
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


# -- 32-weight blocks -------------------------------------------------------------------------


@njit(inline="always")
def _q4_0(blk: np.ndarray, y: np.ndarray) -> None:
    d = _f16(blk, 0)
    qs = blk[2:18]
    for j in range(16):
        q = np.int32(qs[j])
        y[j] = np.float32((q & 15) - 8) * d
        y[j + 16] = np.float32((q >> 4) - 8) * d


@njit(inline="always")
def _q4_1(blk: np.ndarray, y: np.ndarray) -> None:
    d, m = _f16(blk, 0), _f16(blk, 2)
    qs = blk[4:20]
    for j in range(16):
        q = np.int32(qs[j])
        y[j] = np.float32(q & 15) * d + m
        y[j + 16] = np.float32(q >> 4) * d + m


@njit(inline="always")
def _q5_0(blk: np.ndarray, y: np.ndarray) -> None:
    d = _f16(blk, 0)
    qh = np.int64(blk[2]) | (np.int64(blk[3]) << 8) | (np.int64(blk[4]) << 16) | (np.int64(blk[5]) << 24)
    qs = blk[6:22]
    for j in range(16):
        q = np.int32(qs[j])
        lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
        hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
        y[j] = np.float32(lo - 16) * d
        y[j + 16] = np.float32(hi - 16) * d


@njit(inline="always")
def _q5_1(blk: np.ndarray, y: np.ndarray) -> None:
    d, m = _f16(blk, 0), _f16(blk, 2)
    qh = np.int64(blk[4]) | (np.int64(blk[5]) << 8) | (np.int64(blk[6]) << 16) | (np.int64(blk[7]) << 24)
    qs = blk[8:24]
    for j in range(16):
        q = np.int32(qs[j])
        lo = (q & 15) | np.int32(((qh >> j) & 1) << 4)
        hi = (q >> 4) | np.int32(((qh >> (j + 16)) & 1) << 4)
        y[j] = np.float32(lo) * d + m
        y[j + 16] = np.float32(hi) * d + m


@njit(inline="always")
def _q8_0(blk: np.ndarray, y: np.ndarray) -> None:
    d = _f16(blk, 0)
    qs = blk[2:34]
    for j in range(32):
        y[j] = _i8(qs[j]) * d


@njit(inline="always")
def _iq4_nl(blk: np.ndarray, y: np.ndarray) -> None:
    d = _f16(blk, 0)
    qs = blk[2:18]
    for j in range(16):
        q = np.int32(qs[j])
        y[j] = d * _IQ4_NL[q & 15]
        y[j + 16] = d * _IQ4_NL[q >> 4]


@njit(inline="always")
def _mxfp4(blk: np.ndarray, y: np.ndarray) -> None:
    d = _E8M0_HALF[blk[0]]
    qs = blk[1:17]
    for j in range(16):
        q = np.int32(qs[j])
        y[j] = d * _MXFP4[q & 15]
        y[j + 16] = d * _MXFP4[q >> 4]


# -- 256-weight super-blocks ----------------------------------------------------------------


@njit(inline="always")
def _k_scale(s: np.ndarray, i: int) -> tuple[np.float32, np.float32]:
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block i from the 12 packed bytes."""
    if i < 4:
        return np.float32(np.int32(s[i]) & 63), np.float32(np.int32(s[i + 4]) & 63)
    sc = (np.int32(s[i + 4]) & 15) | ((np.int32(s[i - 4]) >> 6) << 4)
    mn = (np.int32(s[i + 4]) >> 4) | ((np.int32(s[i]) >> 6) << 4)
    return np.float32(sc), np.float32(mn)


@njit(inline="always")
def _q4_k(blk: np.ndarray, y: np.ndarray) -> None:
    d, dmin = _f16(blk, 0), _f16(blk, 2)
    s = blk[4:16]
    for c in range(4):
        sc0, m0 = _k_scale(s, 2 * c)
        sc1, m1 = _k_scale(s, 2 * c + 1)
        d0, d1, m0f, m1f = d * sc0, d * sc1, dmin * m0, dmin * m1
        qs = blk[16 + 32 * c : 48 + 32 * c]
        lo, hi = y[64 * c : 64 * c + 32], y[64 * c + 32 : 64 * c + 64]
        for j in range(32):
            q = np.int32(qs[j])
            lo[j] = d0 * np.float32(q & 15) - m0f
            hi[j] = d1 * np.float32(q >> 4) - m1f


@njit(inline="always")
def _q5_k(blk: np.ndarray, y: np.ndarray) -> None:
    d, dmin = _f16(blk, 0), _f16(blk, 2)
    s = blk[4:16]
    qh = blk[16:48]
    for c in range(4):
        sc0, m0 = _k_scale(s, 2 * c)
        sc1, m1 = _k_scale(s, 2 * c + 1)
        d0, d1, m0f, m1f = d * sc0, d * sc1, dmin * m0, dmin * m1
        qs = blk[48 + 32 * c : 80 + 32 * c]
        lo, hi = y[64 * c : 64 * c + 32], y[64 * c + 32 : 64 * c + 64]
        for j in range(32):
            q = np.int32(qs[j])
            h = np.int32(qh[j]) >> (2 * c)
            lo[j] = d0 * np.float32((q & 15) | ((h & 1) << 4)) - m0f
            hi[j] = d1 * np.float32((q >> 4) | ((h & 2) << 3)) - m1f


@njit(inline="always")
def _q6_k(blk: np.ndarray, y: np.ndarray) -> None:
    d = _f16(blk, 208)
    for half in range(2):
        ql = blk[64 * half : 64 * half + 64]
        qh = blk[128 + 32 * half : 160 + 32 * half]
        sc = blk[192 + 8 * half : 200 + 8 * half]
        out = y[128 * half : 128 * half + 128]
        # Each (ql, ql+32, qh) byte triple holds one weight of each 32-weight quarter; a scale covers 16.
        for g in range(2):
            a, b, c, e = d * _i8(sc[g]), d * _i8(sc[2 + g]), d * _i8(sc[4 + g]), d * _i8(sc[6 + g])
            for j in range(16 * g, 16 * g + 16):
                lo, hi, h = np.int32(ql[j]), np.int32(ql[32 + j]), np.int32(qh[j])
                out[j] = a * np.float32(((lo & 15) | ((h & 3) << 4)) - 32)
                out[32 + j] = b * np.float32(((hi & 15) | ((h & 12) << 2)) - 32)
                out[64 + j] = c * np.float32(((lo >> 4) | (h & 48)) - 32)
                out[96 + j] = e * np.float32(((hi >> 4) | ((h & 192) >> 2)) - 32)


@njit(inline="always")
def _iq4_xs(blk: np.ndarray, y: np.ndarray) -> None:
    d = _f16(blk, 0)
    sh = np.int32(blk[2]) | (np.int32(blk[3]) << 8)
    for ib in range(8):
        low = (np.int32(blk[4 + ib // 2]) >> (4 * (ib % 2))) & 15
        ls = low | (((sh >> (2 * ib)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        qs = blk[8 + 16 * ib : 24 + 16 * ib]
        out = y[32 * ib : 32 * ib + 32]
        for j in range(16):
            q = np.int32(qs[j])
            out[j] = dl * _IQ4_NL[q & 15]
            out[j + 16] = dl * _IQ4_NL[q >> 4]


# The registry: quant type -> (weights, bytes) per block. Compiled code reads the codes and sizes
# as constants, so a kernel closed over one type code compiles only that type's branch.
DECODERS: dict[Q, tuple[int, int]] = {
    t: GGML_QUANT_SIZES[t]
    for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
}
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (int(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0))
IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K, IQ4_XS = (int(t) for t in (Q.IQ4_NL, Q.MXFP4, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS))
_SIZE = {int(t): size for t, (_, size) in DECODERS.items()}
S_Q4_0, S_Q4_1, S_Q5_0, S_Q5_1, S_Q8_0 = (_SIZE[t] for t in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0))
S_IQ4_NL, S_MXFP4, S_Q4_K, S_Q5_K, S_Q6_K, S_IQ4_XS = (_SIZE[t] for t in (IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K, IQ4_XS))


def has_kernel(qtype: Q) -> bool:
    return qtype in DECODERS


@njit(inline="always")
def decode_group(code: int, row: np.ndarray, g: int, k: int, y: np.ndarray) -> int:
    """Weights g*GROUP .. of a row of k weights into y; returns how many (GROUP, fewer at a row's end).

    `code` must be a compile-time constant (a kernel closes over it): this is inlined, and only
    the branch of that type is compiled.
    """
    if code == Q4_K:
        _q4_k(row[g * S_Q4_K : (g + 1) * S_Q4_K], y)
        return GROUP
    if code == Q6_K:
        _q6_k(row[g * S_Q6_K : (g + 1) * S_Q6_K], y)
        return GROUP
    if code == Q5_K:
        _q5_k(row[g * S_Q5_K : (g + 1) * S_Q5_K], y)
        return GROUP
    if code == IQ4_XS:
        _iq4_xs(row[g * S_IQ4_XS : (g + 1) * S_IQ4_XS], y)
        return GROUP
    n = min(GROUP, k - g * GROUP)
    b0 = g * (GROUP // 32)
    for i in range(n // 32):
        b, out = b0 + i, y[32 * i : 32 * i + 32]
        if code == Q8_0:
            _q8_0(row[b * S_Q8_0 : (b + 1) * S_Q8_0], out)
        elif code == Q4_0:
            _q4_0(row[b * S_Q4_0 : (b + 1) * S_Q4_0], out)
        elif code == MXFP4:
            _mxfp4(row[b * S_MXFP4 : (b + 1) * S_MXFP4], out)
        elif code == IQ4_NL:
            _iq4_nl(row[b * S_IQ4_NL : (b + 1) * S_IQ4_NL], out)
        elif code == Q4_1:
            _q4_1(row[b * S_Q4_1 : (b + 1) * S_Q4_1], out)
        elif code == Q5_0:
            _q5_0(row[b * S_Q5_0 : (b + 1) * S_Q5_0], out)
        else:
            _q5_1(row[b * S_Q5_1 : (b + 1) * S_Q5_1], out)
    return n
