"""Dequantization of GGML block formats in torch, vectorized, on any device.

One function per type, registered by `GGMLQuantizationType`. Each takes the raw blocks as a
uint8 tensor `[n_blocks, type_size]` and returns float32 `[n_blocks, block_size]`. The
arithmetic follows ggml's reference dequantizers operation by operation (same products in
the same order, in float32) so the results are bit-exact with `gguf.quants.dequantize`;
the tests check that for every type. A faster path for one type can replace its entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .codebooks import IQ4_NL_VALUES, MXFP4_VALUES
from .quant_types import TORCH, types_for

Q = GGMLQuantizationType
Dequantizer = Callable[[torch.Tensor], torch.Tensor]

_REGISTRY: dict[GGMLQuantizationType, Dequantizer] = {}


def _register(qtype: GGMLQuantizationType) -> Callable[[Dequantizer], Dequantizer]:
    def wrap(fn: Dequantizer) -> Dequantizer:
        _REGISTRY[qtype] = fn
        return fn

    return wrap


@cache
def _const(values: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _arange_u8(values: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return _const(values, torch.uint8, str(like.device))


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 stored at byte `at` of each block, as float32 `[nb, 1]`."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[..., n]` bytes -> `[..., 2n]`: all low nibbles, then all high nibbles."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, n_bits: int) -> torch.Tensor:
    """`[nb, n_bytes]` -> `[nb, 8 * n_bytes]`: bit j of the little-endian bit string."""
    shifts = _arange_u8(tuple(range(8)), b)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(b.shape[0], n_bits)


@_register(Q.F32)
def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


@_register(Q.F16)
def _f16_type(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


@_register(Q.BF16)
def _bf16(b: torch.Tensor) -> torch.Tensor:
    return (b.contiguous().view(torch.int16).int() << 16).view(torch.float32)


@_register(Q.Q4_0)
def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)  # [nb, 1]
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8  # [nb, 32]
    return q.float() * d


@_register(Q.Q4_1)
def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20])  # [nb, 32]
    return q.float() * d + m


@_register(Q.Q5_0)
def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    high = _bits(b[:, 2:6], 32)  # [nb, 32]
    q = (_nibbles(b[:, 6:22]) | (high << 4)).to(torch.int8) - 16
    return q.float() * d


@_register(Q.Q5_1)
def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    high = _bits(b[:, 4:8], 32)
    q = _nibbles(b[:, 8:24]) | (high << 4)
    return q.float() * d + m


@_register(Q.Q8_0)
def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:34].view(torch.int8).float() * d


@_register(Q.Q2_K)
def _q2_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    scales = b[:, 0:16]  # 4-bit scale | 4-bit min, one per 16 values
    d, dmin = _f16(b, 80), _f16(b, 82)
    shifts = _arange_u8((0, 2, 4, 6), b).reshape(1, 1, 4, 1)
    q = (b[:, 16:80].reshape(nb, 2, 1, 32) >> shifts) & 3  # [nb, half, shift, 32]
    dl = (d * (scales & 0xF).float()).reshape(nb, 2, 4, 2, 1)
    ml = (dmin * (scales >> 4).float()).reshape(nb, 2, 4, 2, 1)
    return (dl * q.reshape(nb, 2, 4, 2, 16).float() - ml).reshape(nb, 256)


@_register(Q.Q3_K)
def _q3_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    hmask, qs, s = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 six-bit scales: low 4 bits from bytes 0-7 (low then high nibbles), high 2 bits from bytes 8-11.
    low = _nibbles(s[:, 0:8])  # [nb, 16]
    high = ((s[:, 8:12].unsqueeze(1) >> _arange_u8((0, 2, 4, 6), b).reshape(1, 4, 1)) & 3).reshape(nb, 16)
    scale = (low | (high << 4)).to(torch.int8) - 32
    dl = (d * scale.float()).reshape(nb, 2, 4, 2, 1)
    shifts = _arange_u8((0, 2, 4, 6), b).reshape(1, 1, 4, 1)
    q = ((qs.reshape(nb, 2, 1, 32) >> shifts) & 3).to(torch.int8)  # [nb, half, shift, 32]
    hbit = (hmask.reshape(nb, 1, 1, 32) >> _arange_u8(tuple(range(8)), b).reshape(1, 2, 4, 1)) & 1
    q = q - 4 + 4 * hbit.to(torch.int8)  # a clear high bit subtracts 4
    return (dl * q.reshape(nb, 2, 4, 2, 16).float()).reshape(nb, 256)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, `[nb, 8]` each."""
    s0, s1, s2 = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([s0 & 63, (s2 & 0xF) | ((s0 >> 6) << 4)], dim=1)
    mn = torch.cat([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], dim=1)
    return sc, mn


@_register(Q.Q4_K)
def _q4_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, 16:144].reshape(nb, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=2)  # [nb, chunk, low/high, 32]
    d1 = (d * sc.float()).reshape(nb, 4, 2, 1)
    m1 = (dmin * mn.float()).reshape(nb, 4, 2, 1)
    return (d1 * q.float() - m1).reshape(nb, 256)


@_register(Q.Q5_K)
def _q5_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(nb, 1, 1, 32)
    qs = b[:, 48:176].reshape(nb, 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=2)  # [nb, chunk, low/high, 32]
    hbit = (qh >> _arange_u8(tuple(range(8)), b).reshape(1, 4, 2, 1)) & 1  # bit 2*chunk + low/high
    q = q | (hbit << 4)
    d1 = (d * sc.float()).reshape(nb, 4, 2, 1)
    m1 = (dmin * mn.float()).reshape(nb, 4, 2, 1)
    return (d1 * q.float() - m1).reshape(nb, 256)


@_register(Q.Q6_K)
def _q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 1, 2, 32)  # [nb, half, -, first/second 32 of 64, 32]
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].view(torch.int8)
    d = _f16(b, 208)
    low4 = torch.cat([ql & 0xF, ql >> 4], dim=2).reshape(nb, 2, 4, 32)  # quarter k = 2*nibble + which 32
    high2 = (qh >> _arange_u8((0, 2, 4, 6), b).reshape(1, 1, 4, 1)) & 3
    q = (low4 | (high2 << 4)).to(torch.int8) - 32  # [nb, half, quarter, 32]
    dl = (d * sc.float()).reshape(nb, 2, 4, 2, 1)
    return (dl * q.reshape(nb, 2, 4, 2, 16).float()).reshape(nb, 256)


@_register(Q.IQ4_NL)
def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    kv = _const(IQ4_NL_VALUES, torch.float32, str(b.device))
    return d * kv[_nibbles(b[:, 2:18]).long()]


@_register(Q.IQ4_XS)
def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    d = _f16(b, 0)
    scales_h = b[:, 2].int() | (b[:, 3].int() << 8)  # [nb]
    low = _nibbles(b[:, 4:8]).reshape(nb, 2, 4).transpose(1, 2).reshape(nb, 8).int()  # sub-block order
    high = (scales_h.unsqueeze(1) >> (2 * torch.arange(8, device=b.device))) & 3
    ls = (low | (high << 4)) - 32
    dl = (d * ls.float()).reshape(nb, 8, 1)
    kv = _const(IQ4_NL_VALUES, torch.float32, str(b.device))
    q = _nibbles(b[:, 8:136].reshape(nb, 8, 16)).long()  # [nb, 8, 32]
    return (dl * kv[q]).reshape(nb, 256)


@_register(Q.MXFP4)
def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, 0:1].int()  # E8M0 exponent
    # Half of 2^(e-127), as ggml computes it (the code book is doubled): subnormal below e=2.
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    kv = _const(MXFP4_VALUES, torch.float32, str(b.device))
    return d * kv[_nibbles(b[:, 1:17]).long()]


if set(_REGISTRY) != types_for(TORCH):  # the registry claims what is implemented here, no more, no less
    raise ImportError(f"torch dequantizers {sorted(t.name for t in _REGISTRY)} differ from quant_types' TORCH entries")


def supported_types() -> frozenset[GGMLQuantizationType]:
    return frozenset(_REGISTRY)


def is_supported(qtype: GGMLQuantizationType) -> bool:
    return qtype in _REGISTRY


def dequantize(raw: torch.Tensor | np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Raw bytes `[..., row_bytes]` (uint8) -> float32 `[..., row_elements]`."""
    fn = _REGISTRY.get(qtype)
    if fn is None:
        raise NotImplementedError(f"no dequantizer for {qtype.name}")
    t = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw
    if t.dtype != torch.uint8:
        raise TypeError(f"dequantize wants uint8 bytes, got {t.dtype}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    lead, row_bytes = tuple(t.shape[:-1]), t.shape[-1]
    if row_bytes % type_size:
        raise ValueError(f"{qtype.name}: row of {row_bytes} bytes is not a whole number of {type_size}-byte blocks")
    out = fn(t.reshape(-1, type_size))  # [nb, block]
    return out.reshape(*lead, row_bytes // type_size * block)
