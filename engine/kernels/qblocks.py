"""GGUF block layouts as vector code: one entry per quant type, compiled into the kernels.

Each entry turns one block of the file's bytes (a pointer to where it lies) into its weights, 32
at a time, as small integers (LLVM vectors of 32 int8 lanes, unsigned 0..63 or signed) and their
scale: weight = q * scale, plus a per-32 bias for the types with mins or offsets. From that one
description come the two operations the kernels in `kernels.cpu` use (numba intrinsics,
inlined where they are called, so LLVM sees the whole loop and vectorizes it for the machine's CPU):

- `dot_row`: a row's dot products with one or four rows of activations quantized to int16 or
  int8 (`quantize_rows`). For 32-weight blocks: integers per 32 weights, then float32,
  acc += float(sum q * xq) * scale * dx. int16: the products summed in pairs (pmaddwd on x86).
  int8: unsigned weights times signed activations summed in pairs (pmaddubsw on x86 with AVX2;
  a signed weight's sign moves onto the activation), then in fours (pmaddwd), about half the
  instructions per weight. For the super-blocks (the K-quants, IQ4_XS), with the activations' one
  scale per 256: a block's integer form (`IntBlock`: each weight's integer and its integer
  sub-scale) keeps the whole block in int32 (int16: the integer times its sub-scale, then
  pmaddwd, fused into vpdpwssd with VNNI; int8: pmaddubsw, then pmaddwd with the sub-scales, as
  llama.cpp does), and one float multiply-add per 256 weights instead of per 32. Q4_0, Q4_1 and
  MXFP4 with int8 on AVX-512 go four blocks a pass (`QuadBlock`): unsigned weights (MXFP4's code book
  plus an offset that returns as a bias, as Q4_0's), the four blocks' products in two 64-byte
  instructions, one conversion and one multiply-add for the four. The weights'
  integers are unpacked once for the four tokens; each token's operations are the same whatever
  the number of tokens, so how many tokens share a row never changes a token's result.
- `decode_row`: a row's weights as float32 (the tiles a float GEMM multiplies in prefill).

The weights follow the reference dequantizer (`gguf.dequant`, bit-exact with gguf-py) except
that a scale and a min (or offset) are applied in one fused multiply-add: a weight can differ by
one unit in the last place. The dot products' error is the activations' rounding: at most 1.5e-5
(int16) or 0.4% (int8) of the largest activation of their group (256, or 32); the tests bound it
against the exact product.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from llvmlite import ir
from numba.core import cgutils

from ..gguf.codebooks import IQ4_NL_VALUES, MXFP4_VALUES
from ..gguf.quant_types import CPU, types_for
from . import isa
from .jit import intrinsic, njit, overload, prange, types
from .llvm_ir import (
    F32,
    I8,
    I16,
    I32,
    I64,
    LANES,
    V8_F32,
    V_F32,
    V_I8,
    V_I16,
    V_I32,
    VecBuilder,
    byte_ptr,
    call_intrinsic,
    hsum,
    lanes_reduced,
    literal_qtype,
    pair_sums,
    row_ptr,
    vec,
)

SUPER = 256  # weights per super-block (the K-quants, IQ4_XS)

_IQ4_NL = list(IQ4_NL_VALUES)
_MXFP4 = list(MXFP4_VALUES)  # doubled; the scale is halved
_E8M0_HALF = [2.0 ** (e - 128) for e in range(256)]  # MXFP4's scales, halved: all exact in float32
_E8M0_NAME = "moechat_e8m0_half"
# The instructions named below, by the level `isa` chose (the CPU's, or a lower one MOECHAT_CPU_ISA asks for).
# x86's byte shuffle looks up 16 table entries for 16 lanes at once (32 with AVX2); elsewhere one lane at a time.
_X86 = isa.X86
# AVX2: 32-byte integer vectors, and the byte products of the int8 dot products (pmaddubsw).
_AVX2 = isa.AVX2
# AVX-512BW: the same byte and word products on 64-byte vectors, two chunks at once.
_AVX512 = isa.AVX512
# AVX512-VNNI: bytes times bytes summed in fours into int32 in one instruction (vpdpbusd).
_VNNI = isa.VNNI


class Chunk(NamedTuple):
    """32 weights of a block as integers and their scale: weight = q * scale (+ the block's bias)."""

    q: ir.Value  # <32 x i8>: 0..63 when not signed, -128..127 when signed
    signed: bool
    scale: ir.Value  # float32, or <8 x float32>: lanes 0..3 scale weights 0..15, lanes 4..7 weights 16..31


class Block(NamedTuple):
    chunks: list[Chunk]
    bias: ir.Value | None  # per chunk: a float32 (one chunk) or <8 x float32> (eight), added to each weight


class IntChunk(NamedTuple):
    """32 weights of a super-block as integers and their integer scales: weight = q * scale * the block's d."""

    q: ir.Value  # <32 x i8>, as in Chunk
    signed: bool
    scale: ir.Value  # <32 x i16>: each weight's integer scale (|q * scale| <= 4096)


class IntBlock(NamedTuple):
    chunks: list[IntChunk]
    d: ir.Value  # float32: the scale the integer products share
    bias: ir.Value | None  # <8 x float32> per chunk, as Block.bias


# A block's integers and scales; with a pointer to the activations' scales of the block's chunks
# (one per 32, float32), every scale already multiplied by its chunk's (dot products), else not
# (the weights themselves).
Chunks = Callable[[VecBuilder, ir.Value, ir.Value | None], Block]


def _scaled(v: VecBuilder, s: ir.Value, dxp: ir.Value | None) -> ir.Value:
    """Scales s (a float32 for one chunk, 8 floats for 8 chunks, 16 for 8 chunks' halves) times the chunks' dx."""
    if dxp is None:
        return s
    if isinstance(s.type, ir.FloatType):
        return v.b.fmul(s, v.b.load(dxp, align=4))
    dx = v.load(dxp, 0, F32, 8, align=4)
    if s.type.count == 16:
        dx = v.b.shuffle_vector(dx, dx, ir.Constant(vec(I32, 16), [i // 2 for i in range(16)]))
    return v.b.fmul(s, dx)


# -- 32-weight blocks: one chunk each ------------------------------------------------------------


# Q4_0 and Q5_0 keep their integers unsigned and their offset as a bias: an unsigned weight times
# an activation is one instruction on x86, a signed one three.
def _q4_0(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    d = v.f16(p, 0)
    return Block([Chunk(v.nibbles(p, 2), False, _scaled(v, d, dxp))], v.b.fmul(d, ir.Constant(F32, -8.0)))


def _q4_1(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    return Block([Chunk(v.nibbles(p, 4), False, _scaled(v, v.f16(p, 0), dxp))], v.f16(p, 2))


def _q5_0(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    d = v.f16(p, 0)
    q = v.b.or_(v.nibbles(p, 6), v.bits32(p, 2))
    return Block([Chunk(q, False, _scaled(v, d, dxp))], v.b.fmul(d, ir.Constant(F32, -16.0)))


def _q5_1(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    q = v.b.or_(v.nibbles(p, 8), v.bits32(p, 4))
    return Block([Chunk(q, False, _scaled(v, v.f16(p, 0), dxp))], v.f16(p, 2))


def _q8_0(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    return Block([Chunk(v.load(p, 2, I8), True, _scaled(v, v.f16(p, 0), dxp))], None)


def _iq4_nl(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    return Block([Chunk(v.table(v.nibbles(p, 2), _IQ4_NL), True, _scaled(v, v.f16(p, 0), dxp))], None)


def _e8m0_half(v: VecBuilder, p: ir.Value) -> ir.Value:
    """MXFP4's E8M0 scale at p, 2^(e - 127), halved for the doubled code book: looked up in a table of the
    256 values (one load, where computing it with its two subnormal cases took seven instructions)."""
    b = v.b
    e = b.zext(v.scalar(p, 0, I8), I32)
    try:
        tab = b.module.get_global(_E8M0_NAME)  # one table per compiled function
    except KeyError:
        tab = cgutils.global_constant(b.module, _E8M0_NAME, ir.Constant(ir.ArrayType(F32, 256), _E8M0_HALF))
    return b.load(b.gep(tab, [ir.Constant(I32, 0), e]), align=4)


def _mxfp4(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    return Block([Chunk(v.table(v.nibbles(p, 1), _MXFP4), True, _scaled(v, _e8m0_half(v, p), dxp))], None)


class QuadBlock(NamedTuple):
    """Four 32-weight blocks of a 4-bit type in 64-byte vectors, for AVX-512's byte products: each
    block's weights 0..15 (its low nibbles) in `lo`, 16 lanes a block, weights 16..31 in `hi`, as
    unsigned integers, the four blocks' scales, and their biases (what multiplies the sum of a block's
    activations: a min, or an offset that made the integers unsigned times the scale)."""

    lo: ir.Value  # <64 x i8>
    hi: ir.Value  # <64 x i8>
    scales: ir.Value  # <4 x float32>
    bias: ir.Value  # <4 x float32>


def _quad_nibbles(v: VecBuilder, ps: list[ir.Value], off: int) -> tuple[ir.Value, ir.Value]:
    """The 16 bytes at off of each of four blocks -> (low nibbles, high nibbles), <64 x i8> each."""
    b = v.b
    nib = [v.load(p, off, I8, 16) for p in ps]

    def cat(x: ir.Value, y: ir.Value) -> ir.Value:
        n = 2 * x.type.count
        return b.shuffle_vector(x, y, ir.Constant(vec(I32, n), list(range(n))))

    q = cat(cat(nib[0], nib[1]), cat(nib[2], nib[3]))  # 16 bytes a block
    return b.and_(q, ir.Constant(vec(I8, 64), [15] * 64)), b.lshr(q, ir.Constant(vec(I8, 64), [4] * 64))


def _quad_f16(v: VecBuilder, ps: list[ir.Value], off: int) -> ir.Value:
    """The float16 at off of each of four blocks -> <4 x float32>."""
    out = ir.Constant(vec(F32, 4), None)
    for j, p in enumerate(ps):
        out = v.b.insert_element(out, v.f16(p, off), ir.Constant(I32, j))
    return out


def _offset_bias(v: VecBuilder, scales: ir.Value, offset: int) -> ir.Value:
    return v.b.fmul(scales, ir.Constant(vec(F32, 4), [-float(offset)] * 4))


def _q4_0_quad(v: VecBuilder, ps: list[ir.Value]) -> QuadBlock:
    lo, hi = _quad_nibbles(v, ps, 2)
    scales = _quad_f16(v, ps, 0)
    return QuadBlock(lo, hi, scales, _offset_bias(v, scales, 8))


def _q4_1_quad(v: VecBuilder, ps: list[ir.Value]) -> QuadBlock:
    lo, hi = _quad_nibbles(v, ps, 4)
    return QuadBlock(lo, hi, _quad_f16(v, ps, 0), _quad_f16(v, ps, 2))


def _mxfp4_quad(v: VecBuilder, ps: list[ir.Value]) -> QuadBlock:
    # The code book plus 12 is 0..24: an unsigned byte times an activation is one instruction, where a
    # signed one took three (abs, sign, product); the offset comes back as a bias, as for Q4_0.
    b = v.b
    tab = ir.Constant(vec(I8, 64), [c + 12 for c in _MXFP4] * 4)

    def look(idx: ir.Value) -> ir.Value:
        return call_intrinsic(b, "llvm.x86.avx512.pshuf.b.512", vec(I8, 64), [tab, idx])

    lo, hi = _quad_nibbles(v, ps, 1)
    scales = ir.Constant(vec(F32, 4), None)
    for j, p in enumerate(ps):
        scales = b.insert_element(scales, _e8m0_half(v, p), ir.Constant(I32, j))
    return QuadBlock(look(lo), look(hi), scales, _offset_bias(v, scales, 12))


# -- 256-weight super-blocks: eight chunks each --------------------------------------------------


def _k_scales(v: VecBuilder, p: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Q4_K/Q5_K: the eight 6-bit scales and mins packed in the 12 bytes at 4, as <8 x float32>."""
    sc, mn = _k_scale_ints(v, p)
    return v.b.uitofp(v.b.zext(sc, vec(I32, 8)), V8_F32), v.b.uitofp(v.b.zext(mn, vec(I32, 8)), V8_F32)


def _k_scale_ints(v: VecBuilder, p: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Q4_K/Q5_K: the eight 6-bit scales and mins packed in the 12 bytes at 4, as <8 x i8>."""
    b = v.b
    s = v.load(p, 4, I8, 16)  # bytes 4..19: the 12 packed bytes and 4 of the quants, never used
    zero = ir.Constant(vec(I8, 16), None)

    def pick(lanes: list[int]) -> ir.Value:  # lane 16: a zero
        return b.shuffle_vector(s, zero, ir.Constant(vec(I32, 8), lanes))

    def c8(values: list[int]) -> ir.Constant:
        return ir.Constant(vec(I8, 8), values)

    def top2(x: ir.Value) -> ir.Value:  # a byte's top two bits, as bits 4 and 5
        return b.shl(b.lshr(x, c8([6] * 8)), c8([4] * 8))

    # Sub-blocks 0..3: the low 6 bits of bytes 0..3 (scales) and 4..7 (mins). Sub-blocks 4..7: the
    # low (scales) and high (mins) nibbles of bytes 8..11, with the top 2 bits of bytes 0..7 above.
    sc = b.or_(b.and_(pick([0, 1, 2, 3, 8, 9, 10, 11]), c8([63] * 4 + [15] * 4)), top2(pick([16] * 4 + [0, 1, 2, 3])))
    mn = b.or_(b.and_(b.lshr(pick([4, 5, 6, 7, 8, 9, 10, 11]), c8([0] * 4 + [4] * 4)), c8([63] * 8)),
               top2(pick([16] * 4 + [4, 5, 6, 7])))  # fmt: skip
    return sc, mn


def _k_block(v: VecBuilder, p: ir.Value, dxp: ir.Value | None, q: Callable[[int], ir.Value]) -> Block:
    """Q4_K/Q5_K: chunk j's integers q(j) (<32 x i8>, 0..31) scaled by d * scale_j, less dmin * min_j."""
    sc, mn = _k_scales(v, p)
    scales = _scaled(v, v.b.fmul(sc, v.splat(v.f16(p, 0), 8)), dxp)
    chunks = [Chunk(q(j), False, v.b.extract_element(scales, ir.Constant(I32, j))) for j in range(8)]
    return Block(chunks, v.b.fneg(v.b.fmul(mn, v.splat(v.f16(p, 2), 8))))


def _k_ints(v: VecBuilder, p: ir.Value, q: Callable[[int], ir.Value]) -> IntBlock:
    """Q4_K/Q5_K in integers: chunk j's q(j) times its 6-bit scale, d; the mins as the bias."""
    sc, mn = _k_scale_ints(v, p)
    sc16 = v.b.zext(sc, vec(I16, 8))
    chunks = [IntChunk(q(j), False, v.b.shuffle_vector(sc16, sc16, ir.Constant(V_I32, [j] * LANES)))
              for j in range(8)]  # fmt: skip
    bias = v.b.fneg(v.b.fmul(v.b.uitofp(v.b.zext(mn, vec(I32, 8)), V8_F32), v.splat(v.f16(p, 2), 8)))
    return IntBlock(chunks, v.f16(p, 0), bias)


def _q4_k_q(v: VecBuilder, p: ir.Value, j: int) -> ir.Value:
    packed = v.load(p, 16 + 32 * (j // 2), I8)  # chunks 2c and 2c + 1: low and high nibbles
    return v.b.and_(packed, v.const(I8, 15)) if j % 2 == 0 else v.b.lshr(packed, v.const(I8, 4))


def _q5_k_q(v: VecBuilder, p: ir.Value, j: int) -> ir.Value:
    packed = v.load(p, 48 + 32 * (j // 2), I8)
    nib = v.b.and_(packed, v.const(I8, 15)) if j % 2 == 0 else v.b.lshr(packed, v.const(I8, 4))
    high = v.b.shl(v.b.and_(v.b.lshr(v.load(p, 16, I8), v.const(I8, j)), v.const(I8, 1)), v.const(I8, 4))
    return v.b.or_(nib, high)


def _q4_k(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    return _k_block(v, p, dxp, lambda j: _q4_k_q(v, p, j))


def _q4_k_ints(v: VecBuilder, p: ir.Value) -> IntBlock:
    return _k_ints(v, p, lambda j: _q4_k_q(v, p, j))


def _q5_k(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    return _k_block(v, p, dxp, lambda j: _q5_k_q(v, p, j))


def _q5_k_ints(v: VecBuilder, p: ir.Value) -> IntBlock:
    return _k_ints(v, p, lambda j: _q5_k_q(v, p, j))


def _q6_k_qs(v: VecBuilder, p: ir.Value) -> list[tuple[ir.Value, int]]:
    """Q6_K's eight chunks: (integers -32..31, the index s of its first scale: s for weights 0..15, s + 1 after)."""
    b = v.b
    out = []
    for half in range(2):
        lo, hi, qh = v.load(p, 64 * half, I8), v.load(p, 64 * half + 32, I8), v.load(p, 128 + 32 * half, I8)
        # Each (lo, hi, qh) byte triple holds one weight of each 32-weight quarter of this half.
        for quarter, (src, shift) in enumerate(((lo, 0), (hi, 0), (lo, 4), (hi, 4))):
            low = b.and_(b.lshr(src, v.const(I8, shift)), v.const(I8, 15))
            high = b.shl(b.and_(b.lshr(qh, v.const(I8, 2 * quarter)), v.const(I8, 3)), v.const(I8, 4))
            out.append((b.sub(b.or_(low, high), v.const(I8, 32)), 8 * half + 2 * quarter))
    return out


def _q6_k(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    b = v.b
    # 16 scales, each over 16 weights
    sc = _scaled(v, b.fmul(b.sitofp(v.load(p, 192, I8, 16), vec(F32, 16)), v.splat(v.f16(p, 208), 16)), dxp)
    chunks = [Chunk(q, True, b.shuffle_vector(sc, sc, ir.Constant(vec(I32, 8), [s] * 4 + [s + 1] * 4)))
              for q, s in _q6_k_qs(v, p)]  # fmt: skip
    return Block(chunks, None)


def _q6_k_ints(v: VecBuilder, p: ir.Value) -> IntBlock:
    b = v.b
    sc16 = b.sext(v.load(p, 192, I8, 16), vec(I16, 16))
    chunks = [IntChunk(q, True, b.shuffle_vector(sc16, sc16, ir.Constant(V_I32, [s] * 16 + [s + 1] * 16)))
              for q, s in _q6_k_qs(v, p)]  # fmt: skip
    return IntBlock(chunks, v.f16(p, 208), None)


def _iq4_xs(v: VecBuilder, p: ir.Value, dxp: ir.Value | None) -> Block:
    b = v.b
    sc = _iq4_xs_scales(v, p)
    scales = _scaled(v, b.fmul(b.sitofp(sc, V8_F32), v.splat(v.f16(p, 0), 8)), dxp)
    chunks = [Chunk(v.table(v.nibbles(p, 8 + 16 * j), _IQ4_NL), True, b.extract_element(scales, ir.Constant(I32, j)))
              for j in range(8)]  # fmt: skip
    return Block(chunks, None)


def _iq4_xs_scales(v: VecBuilder, p: ir.Value) -> ir.Value:
    """IQ4_XS's eight scales, -32..31, as <8 x i32>."""
    b = v.b
    # The eight 6-bit scales: low nibbles of the 4 bytes at 4, high 2 bits of the uint16 at 2.
    lo = v.load(p, 4, I8, 4)
    lo = b.shuffle_vector(lo, lo, ir.Constant(vec(I32, 8), [i // 2 for i in range(8)]))
    lo = b.lshr(lo, ir.Constant(vec(I8, 8), [4 * (i % 2) for i in range(8)]))
    lo = b.and_(lo, ir.Constant(vec(I8, 8), [15] * 8))
    hi = b.lshr(v.splat(b.zext(v.scalar(p, 2, I16), I32), 8), ir.Constant(vec(I32, 8), [2 * i for i in range(8)]))
    hi = b.shl(b.and_(hi, ir.Constant(vec(I32, 8), [3] * 8)), ir.Constant(vec(I32, 8), [4] * 8))
    return b.sub(b.or_(b.zext(lo, vec(I32, 8)), hi), ir.Constant(vec(I32, 8), [32] * 8))


def _iq4_xs_ints(v: VecBuilder, p: ir.Value) -> IntBlock:
    sc16 = v.b.trunc(_iq4_xs_scales(v, p), vec(I16, 8))
    chunks = [IntChunk(v.table(v.nibbles(p, 8 + 16 * j), _IQ4_NL), True,
                       v.b.shuffle_vector(sc16, sc16, ir.Constant(V_I32, [j] * LANES))) for j in range(8)]  # fmt: skip
    return IntBlock(chunks, v.f16(p, 0), None)


@dataclass(frozen=True)
class Layout:
    weights: int  # per block
    size: int  # bytes per block
    chunks: Chunks  # a block's weights as integers and scales, 32 at a time
    # A super-block's integers with integer scales (see IntBlock): with the activations' one scale per
    # 256, its dot products stay integers over the whole block (int16 activations)
    ints: Callable[[VecBuilder, ir.Value], IntBlock] | None = None
    # Four 32-weight blocks at once in 64-byte vectors (int8 activations, AVX-512), where a type has it
    quad: Callable[[VecBuilder, list[ir.Value]], QuadBlock] | None = None


def _layout(qtype: Q, chunks: Chunks) -> Layout:
    weights, size = GGML_QUANT_SIZES[qtype]
    return Layout(weights, size, chunks, _INTS.get(qtype), _QUADS.get(qtype))


_CHUNKS: dict[Q, Chunks] = {
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.IQ4_NL: _iq4_nl, Q.MXFP4: _mxfp4,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.IQ4_XS: _iq4_xs,
}  # fmt: skip
_INTS: dict[Q, Callable[[VecBuilder, ir.Value], IntBlock]] = {
    Q.Q4_K: _q4_k_ints, Q.Q5_K: _q5_k_ints, Q.Q6_K: _q6_k_ints, Q.IQ4_XS: _iq4_xs_ints,
}  # fmt: skip
_QUADS: dict[Q, Callable[[VecBuilder, list[ir.Value]], QuadBlock]] = {
    Q.Q4_0: _q4_0_quad, Q.Q4_1: _q4_1_quad, Q.MXFP4: _mxfp4_quad,
}  # fmt: skip
# One entry per quant type the registry (gguf.quant_types) gives the CPU kernels: its whole block layout.
# A type claimed there without its chunks here fails at import.
LAYOUTS: dict[Q, Layout] = {t: _layout(t, _CHUNKS[t]) for t in sorted(types_for(CPU))}


# -- activations as the dot products read them ---------------------------------------------------

ACTIVATION_BITS = (8, 16)
PARALLEL_ROWS = 16  # from this many rows (a prompt) activations are quantized over the kernel's threads
ACT16 = 32767  # int16: the rounding is at most 1.5e-5 of the largest activation of its 256 (or 32)
ACT8 = 127  # int8: at most 0.4%


@njit(inline="always")
def _quantize_row(x: np.ndarray, row: int, xq: np.ndarray, dx: np.ndarray, bs: np.ndarray, top: float,
                  group: int, off: int) -> None:  # fmt: skip
    """Row `row` of x [R, K] (float32, K a multiple of `group`) as integers in -top..top with one scale
    per `group` activations (32 or 256), into columns off.. of xq; the scale once per 32 into dx
    (from column off / 32), and per 32 activations the scale times their sum in bs (what a
    block's bias multiplies). Loops: any layout of x."""
    for g in range(x.shape[1] // group):
        m = np.float32(0)
        for i in range(g * group, g * group + group):
            m = max(m, abs(x[row, i]))
        d = m / np.float32(top)
        inv = np.float32(top) / m if m > 0 else np.float32(0)
        for c in range(g * group // LANES, (g + 1) * group // LANES):
            s = 0
            for i in range(c * LANES, c * LANES + LANES):
                q = int(np.rint(x[row, i] * inv))
                xq[row, off + i] = q
                s += q
            dx[row, off // LANES + c] = d
            bs[row, off // LANES + c] = d * np.float32(s)


@njit(inline="always")
def _quantize_row_vectors(x: np.ndarray, row: int, xq: np.ndarray, dx: np.ndarray, bs: np.ndarray, top: float,
                          group: int, off: int) -> None:  # fmt: skip
    """_quantize_row for rows whose elements lie together, 32 activations a vector step. The same
    values: a maximum and integer sums do not depend on their order, and each element's product and
    rounding are the loop's."""
    for g in range(x.shape[1] // group):
        m = _abs_max(x, row, g * group, group)
        d = m / np.float32(top)
        inv = np.float32(top) / m if m > 0 else np.float32(0)
        for c in range(g * group // LANES, (g + 1) * group // LANES):
            s = _round32(x, row, c * LANES, inv, xq, off + c * LANES)
            dx[row, off // LANES + c] = d
            bs[row, off // LANES + c] = d * np.float32(s)


def quantize_rows(x: np.ndarray, rows: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of x [R, K] a kernel reads, quantized for the dot products to int8 or int16 (`bits`,
    a compile-time constant): (xq, dx, bs) with one scale per 32 (dx, bs: [R, columns of xq / 32]);
    other rows left unset. Compiled code only.

    A super-block's products add up in integers (`Layout.ints`) when its activations share one
    scale per 256. int16 takes one per 256 wherever K allows: xq [R, K]. int8's rounding is 128
    times coarser, so the blocks of 32 keep one per 32, and where K allows xq [R, 2K] holds both:
    columns 0..K-1 one scale per 32, columns K..2K-1 one per 256 (as llama.cpp's Q8_K)."""
    raise NotImplementedError("quantize_rows runs in compiled code")


@overload(quantize_rows, inline="always")
def _quantize_rows(x, rows, bits):
    return _quantize_impl(x, bits, parallel=False)


def quantize_many(x: np.ndarray, rows: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`quantize_rows`, with the rows split over a parallel kernel's threads from PARALLEL_ROWS rows on
    (a prompt). Only the kernels that take prompts use it: the parallel loop costs every kernel that
    holds it compile time, and the decode blocks quantize one row. Compiled code only."""
    raise NotImplementedError("quantize_many runs in compiled code")


@overload(quantize_many, inline="always")
def _quantize_many(x, rows, bits):
    return _quantize_impl(x, bits, parallel=True)


def _quantize_impl(x: Any, bits: Any, parallel: bool) -> Any:
    if not isinstance(bits, types.IntegerLiteral):
        return None
    if bits.literal_value not in ACTIVATION_BITS:
        raise ValueError(f"activations are quantized to {ACTIVATION_BITS} bits, not {bits.literal_value}")
    dtype, top = (np.int8, ACT8) if bits.literal_value == 8 else (np.int16, ACT16)
    int8 = bits.literal_value == 8

    # A C-ordered x takes the vector steps (decided as the kernel compiles, so it holds one of the two)
    quantize_row = _quantize_row_vectors if _c_rows(x) else _quantize_row

    def impl(x, rows, bits):
        n, k = x.shape
        supers = k % SUPER == 0
        width = 2 * k if int8 and supers else k
        xq = np.empty((n, width), dtype)
        dx = np.empty((n, width // LANES), np.float32)
        bs = np.empty((n, width // LANES), np.float32)
        group = SUPER if supers and not int8 else LANES
        if parallel:  # noqa: SIM102 - a constant: numba drops the branch where it is False
            if rows.shape[0] >= PARALLEL_ROWS:
                for i in prange(rows.shape[0]):
                    quantize_row(x, rows[i], xq, dx, bs, top, group, 0)
                    if int8 and supers:
                        quantize_row(x, rows[i], xq, dx, bs, top, SUPER, k)
                return xq, dx, bs
        for i in range(rows.shape[0]):
            quantize_row(x, rows[i], xq, dx, bs, top, group, 0)
            if int8 and supers:
                quantize_row(x, rows[i], xq, dx, bs, top, SUPER, k)
        return xq, dx, bs

    return impl


# -- intrinsics ----------------------------------------------------------------------------------


_ONES16 = ir.Constant(vec(I16, 16), [1] * 16)
# A row's blocks are asked for this many bytes before they are read: on Intel's server cores
# (Emerald Rapids) the hardware's own prefetchers leave one stream a core well short of the memory's
# speed (design.md); where they do not (Zen 4) the prefetch costs nothing measurable.
PREFETCH_AHEAD = 2048


def _prefetch(v: VecBuilder, p: ir.Value, span: int) -> None:
    """Ask for the cache lines PREFETCH_AHEAD bytes past the `span` bytes at p, into L1 (past a
    matrix's end too: a prefetch never faults)."""
    read, keep, data = ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)
    for off in range(0, span, 64):
        call_intrinsic(v.b, "llvm.prefetch.p0i8", ir.VoidType(), [v.at(p, PREFETCH_AHEAD + off), read, keep, data])


def _c_rows(x: Any) -> bool:
    """Whether x is a float32 matrix whose rows' elements lie together: what the vector steps read."""
    return isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 2 and x.layout == "C"


def _folded_row(context: Any, b: ir.IRBuilder, aty: Any, args: Any,
                step: Callable[[ir.Value, ir.Value], ir.Value]) -> ir.Value:  # fmt: skip
    """x[row, col:col + n] (args: x, row, col, n; n a multiple of 32) folded 32 floats at a time into one
    <32 x float32> accumulator from zeros: acc = step(acc, chunk)."""
    v = VecBuilder(b)
    p = v.at(row_ptr(context, b, aty, args[0], args[1], F32), args[2])
    acc = cgutils.alloca_once_value(b, ir.Constant(V_F32, None))
    with cgutils.for_range(b, b.udiv(args[3], ir.Constant(I64, LANES))) as c:
        xs = v.load(p, b.mul(c.index, ir.Constant(I64, LANES)), F32, align=4)
        b.store(step(b.load(acc), xs), acc)
    return b.load(acc)


def _abs_max_typing(typingctx: Any, x: Any, row: Any, col: Any, n: Any) -> Any:
    """max |x[row, col + i]| over i < n, n a multiple of 32 (x [R, K] float32, C order)."""
    if not _c_rows(x):
        return None
    sig = types.float32(x, types.int64, types.int64, types.int64)

    def codegen(context: Any, b: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        def maxnum(x: ir.Value, y: ir.Value) -> ir.Value:
            return call_intrinsic(b, f"llvm.maxnum.v{x.type.count}f32", x.type, [x, y])

        acc = _folded_row(context, b, sig.args[0], args,
                          lambda acc, xs: maxnum(acc, call_intrinsic(b, "llvm.fabs.v32f32", V_F32, [xs])))  # fmt: skip
        return lanes_reduced(b, acc, maxnum)

    return sig, codegen


def _round32_typing(typingctx: Any, x: Any, row: Any, col: Any, inv: Any, xq: Any, qcol: Any) -> Any:
    """xq[row, qcol + i] = rint(x[row, col + i] * inv) for i < 32 (int8 or int16 xq, C order), and
    their sum."""
    if not (_c_rows(x) and isinstance(xq, types.Array) and xq.layout == "C" and xq.dtype in (types.int8, types.int16)):
        return None
    qt = I8 if xq.dtype == types.int8 else I16
    sig = types.int64(x, types.int64, types.int64, types.float32, xq, types.int64)

    def codegen(context: Any, b: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        v = VecBuilder(b)
        xs = v.load(v.at(row_ptr(context, b, sig.args[0], args[0], args[1], F32), args[2]), 0, F32, align=4)
        r = call_intrinsic(b, "llvm.rint.v32f32", V_F32, [b.fmul(xs, v.splat(args[3]))])
        q = b.fptosi(r, V_I32)
        dst = v.at(row_ptr(context, b, sig.args[4], args[4], args[1], qt), args[5])
        b.store(b.trunc(q, vec(qt)), b.bitcast(dst, vec(qt).as_pointer()), align=1)
        return b.sext(lanes_reduced(b, q, b.add), I64)

    return sig, codegen


_abs_max: Any = intrinsic(_abs_max_typing)
_round32: Any = intrinsic(_round32_typing)


def _squares_typing(typingctx: Any, x: Any, row: Any, n: Any) -> Any:
    """The sum of x[row, i]^2 over i < n, n a multiple of 32 (x [R, K] float32, C order): 32 running
    sums, one per lane, then halves added pairwise. The order is the code's, not the caller's."""
    if not _c_rows(x):
        return None
    sig = types.float32(x, types.int64, types.int64)

    def codegen(context: Any, b: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        v = VecBuilder(b)
        acc = _folded_row(context, b, sig.args[0], [args[0], args[1], ir.Constant(I64, 0), args[2]],
                          lambda acc, xs: v.fma(xs, xs, acc))  # fmt: skip
        return hsum(b, acc)

    return sig, codegen


_squares: Any = intrinsic(_squares_typing)


def sum_squares(x: np.ndarray, row: int, n: int) -> float:
    """The sum of x[row, :n]^2 (float32) in an order fixed by this code: in vectors where x is C-ordered,
    else one element after another. Compiled code only."""
    raise NotImplementedError("sum_squares runs in compiled code")


@overload(sum_squares, inline="always")
def _sum_squares(x, row, n):
    if _c_rows(x):

        def vectors(x, row, n):
            whole = n // LANES * LANES
            ss = _squares(x, row, whole)
            for d in range(whole, n):
                ss += x[row, d] * x[row, d]
            return ss

        return vectors

    def loop(x, row, n):
        ss = np.float32(0)
        for d in range(n):
            ss += x[row, d] * x[row, d]
        return ss

    return loop


def _dot32(v: VecBuilder, q: ir.Value, magnitude: ir.Value, signed: bool, x: ir.Value) -> ir.Value:
    """32 weights' integers q times 32 int8 activations x, summed in fours: <8 x i32> (lane i:
    weights 4i..4i+3). `magnitude` is |q| (for signed q). On x86 with AVX2: pmaddubsw (unsigned
    times signed bytes, summed in pairs; the weights' ranges keep it from saturating) and pmaddwd;
    with AVX512-VNNI, vpdpbusd (both in one)."""
    b = v.b
    if _AVX2:
        if signed:  # |q| times x with q's sign
            x = call_intrinsic(b, "llvm.x86.avx2.psign.b", V_I8, [x, q])
        if _VNNI:  # the same sums in one instruction (and no int16 step to saturate)
            v8 = vec(I32, 8)
            return call_intrinsic(b, "llvm.x86.avx512.vpdpbusd.256", v8,
                         [ir.Constant(v8, None), b.bitcast(magnitude, v8), b.bitcast(x, v8)])  # fmt: skip
        p16 = call_intrinsic(b, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [magnitude, x])
        return call_intrinsic(b, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [p16, _ONES16])
    wide = b.sext(q, V_I16) if signed else b.zext(q, V_I16)
    p16 = pair_sums(b, b.mul(wide, b.sext(x, V_I16)))  # exact: |q * x| <= 128 * 127, twice
    return pair_sums(b, b.sext(p16, vec(I32, 16)))


def _dot32_wide(v: VecBuilder, q: ir.Value, signed: bool, x: ir.Value) -> ir.Value:
    """32 weights' integers q times 32 int16 activations x, summed in pairs: <16 x i32> (pmaddwd)."""
    b = v.b
    wide = b.sext(q, V_I32) if signed else b.zext(q, V_I32)
    return pair_sums(b, b.mul(wide, b.sext(x, V_I32)))


def _magnitude(v: VecBuilder, chunk: Chunk) -> ir.Value:
    if not (_AVX2 and chunk.signed):
        return chunk.q
    return call_intrinsic(v.b, "llvm.abs.v32i8", V_I8, [chunk.q, ir.Constant(ir.IntType(1), 0)])


def _decode_intrinsic(layout: Layout) -> Any:
    @intrinsic
    def decode(typingctx, w, w_off, n_blocks, y, y_off):  # numba's signature: no annotations
        """n_blocks blocks at byte w_off of w -> their weights as float32 at byte y_off of y."""
        sig = types.void(w, types.int64, types.int64, y, types.int64)

        def codegen(context, builder, sig, args):
            v = VecBuilder(builder)
            b = builder
            wp = byte_ptr(context, b, sig.args[0], args[0], args[1])
            yp = b.bitcast(byte_ptr(context, b, sig.args[3], args[3], args[4]), F32.as_pointer())
            with cgutils.for_range(b, args[2]) as loop:
                block = layout.chunks(v, v.at(wp, b.mul(loop.index, ir.Constant(I64, layout.size))), None)
                row = v.at(yp, b.mul(loop.index, ir.Constant(I64, layout.weights)))
                for c, (q, _, scale) in enumerate(block.chunks):
                    if isinstance(scale.type, ir.VectorType):
                        scale = b.shuffle_vector(scale, scale, ir.Constant(V_I32, [0] * 16 + [4] * 16))
                    else:
                        scale = v.splat(scale)
                    w = b.sitofp(q, V_F32)
                    if block.bias is None:
                        w = b.fmul(w, scale)
                    else:
                        bias = block.bias
                        if isinstance(bias.type, ir.VectorType):
                            bias = b.extract_element(bias, ir.Constant(I32, c))
                        w = v.fma(w, scale, v.splat(bias))
                    b.store(w, b.bitcast(v.at(row, c * LANES), V_F32.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return decode


def _dot_intrinsic(layout: Layout, nt: int, bits: int) -> Any:
    """The dot products of one quantized row with nt rows of activations quantized to `bits` (8 or
    16), in integers per 32 weights, then float32: acc += float(sum of q * xq) * scale * dx,
    lane-wise, and the block biases times bs. Each token's operations are the same whatever nt is:
    the same result."""
    act = I8 if bits == 8 else I16
    ints = layout.ints
    # Four blocks a pass in 64-byte vectors: a quarter of the per-block float work, and unsigned weights
    quads = layout.quad if _AVX512 and bits == 8 else None

    @intrinsic
    def dot(typingctx, w, w_off, n_blocks, xq, dx, bs, rows):
        sig = types.UniTuple(types.float32, nt)(w, types.int64, types.int64, xq, dx, bs, rows)

        def codegen(context, builder, sig, args):
            v = VecBuilder(builder)
            b = builder
            wp = byte_ptr(context, b, sig.args[0], args[0], args[1])
            rows = cgutils.unpack_tuple(b, args[6], nt) if nt > 1 else [args[6]]

            xps = [row_ptr(context, b, sig.args[3], args[3], r, act) for r in rows]
            dps = [row_ptr(context, b, sig.args[4], args[4], r, F32) for r in rows]
            bps = [row_ptr(context, b, sig.args[5], args[5], r, F32) for r in rows]
            # Two accumulators, for even and odd chunks: two chains of dependent FMAs, not one.
            acc8 = [[cgutils.alloca_once_value(b, ir.Constant(V8_F32, None)) for _ in range(2)] for _ in range(nt)]
            acc16 = [
                [cgutils.alloca_once_value(b, ir.Constant(vec(F32, 16), None)) for _ in range(2)] for _ in range(nt)
            ]
            accb = [cgutils.alloca_once_value(b, ir.Constant(V8_F32, None)) for _ in range(nt)]
            accs = [cgutils.alloca_once_value(b, ir.Constant(F32, None)) for _ in range(nt)]
            accq = [cgutils.alloca_once_value(b, ir.Constant(vec(F32, 4), None)) for _ in range(nt)]
            used: set[str] = set()

            def block_dots(index: ir.Value, par: int) -> None:
                """Block `index`'s products into the accumulators; `par` picks which chain its chunks start on."""
                first = b.mul(index, ir.Constant(I64, layout.weights))  # the block's first weight
                block_p = v.at(wp, b.mul(index, ir.Constant(I64, layout.size)))
                _prefetch(v, block_p, layout.size)
                sums = b.udiv(first, ir.Constant(I64, LANES))  # the block's first chunk
                if ints is not None:
                    # int8: the activations of one scale per 256 are the second half of each row
                    ahead = b.mul(args[2], ir.Constant(I64, layout.weights)) if bits == 8 else ir.Constant(I64, 0)
                    _int_block(v, ints(v, block_p), bits, b.add(first, ahead),
                               b.add(sums, b.udiv(ahead, ir.Constant(I64, LANES))), xps, dps, bps,
                               [a[0] for a in acc16], accb)  # fmt: skip
                    used.update(("16", "b"))
                else:
                    magnitudes: list[ir.Value] = []
                    for t in range(nt):
                        block = layout.chunks(v, block_p, v.at(dps[t], sums))
                        if not magnitudes and bits == 8:  # the weights' integers, unpacked once for all the tokens
                            magnitudes = [_magnitude(v, chunk) for chunk in block.chunks]
                        for c, (q, signed, scale) in enumerate(block.chunks):
                            x = v.load(xps[t], b.add(first, ir.Constant(I64, c * LANES)), act, align=bits // 8)
                            if bits == 8:
                                m = b.sitofp(_dot32(v, q, magnitudes[c], signed, x), V8_F32)
                                acc = acc8[t][(c + par) % 2]
                                scale = scale if isinstance(scale.type, ir.VectorType) else v.splat(scale, 8)
                                b.store(v.fma(m, scale, b.load(acc)), acc)
                                continue
                            m = _dot32_wide(v, q, signed, x)  # <16 x i32>
                            if isinstance(scale.type, ir.VectorType):
                                acc = acc16[t][(c + par) % 2]
                                scale = b.shuffle_vector(scale, scale, ir.Constant(vec(I32, 16), [0] * 8 + [4] * 8))
                                b.store(v.fma(b.sitofp(m, vec(F32, 16)), scale, b.load(acc)), acc)
                                used.add("16")
                            elif _AVX512:  # one scale, 16 lanes in one register: no halves to add first
                                acc = acc16[t][(c + par) % 2]
                                b.store(v.fma(b.sitofp(m, vec(F32, 16)), v.splat(scale, 16), b.load(acc)), acc)
                                used.add("16")
                            else:  # one scale: the two halves' integer sums first
                                halves = [b.shuffle_vector(m, m, ir.Constant(vec(I32, 8), list(range(h, h + 8))))
                                          for h in (0, 8)]  # fmt: skip
                                acc = acc8[t][(c + par) % 2]
                                b.store(v.fma(b.sitofp(b.add(*halves), V8_F32), v.splat(scale, 8), b.load(acc)), acc)
                        if block.bias is not None:
                            if isinstance(block.bias.type, ir.VectorType):
                                bsum = v.load(bps[t], sums, F32, 8, align=4)
                                b.store(v.fma(block.bias, bsum, b.load(accb[t])), accb[t])
                                used.add("b")
                            else:
                                bsum = b.load(v.at(bps[t], sums), align=4)
                                b.store(_fma1(b, block.bias, bsum, b.load(accs[t])), accs[t])
                                used.add("s")

            def quad_dots(index: ir.Value, four: Callable[[VecBuilder, list[ir.Value]], QuadBlock]) -> None:
                """Blocks index..index+3 (`four`: their quad) into acc16[t][0], their offsets' bias into accq[t]."""
                size = ir.Constant(I64, layout.size)
                quad_p = [v.at(wp, b.mul(b.add(index, ir.Constant(I64, j)), size)) for j in range(4)]
                _prefetch(v, quad_p[0], 4 * layout.size)
                quad = four(v, quad_p)
                first = b.mul(index, ir.Constant(I64, LANES))  # the first block's first weight
                v16 = vec(I32, 16)
                # activations 0..15 of each of the four blocks, then 16..31: the order of lo and hi
                halves = [[32 * j + h + i for j in range(4) for i in range(16)] for h in (0, 16)]
                for t in range(nt):
                    xa = v.load(xps[t], first, I8, 64)
                    xb = v.load(xps[t], b.add(first, ir.Constant(I64, 64)), I8, 64)
                    xs = [b.shuffle_vector(xa, xb, ir.Constant(vec(I32, 64), h)) for h in halves]
                    if _VNNI:
                        sums = ir.Constant(v16, None)
                        for w, x in zip((quad.lo, quad.hi), xs, strict=True):
                            sums = call_intrinsic(b, "llvm.x86.avx512.vpdpbusd.512", v16,
                                         [sums, b.bitcast(w, v16), b.bitcast(x, v16)])  # fmt: skip
                    else:  # weights <= 24: |pair| <= 2 * 24 * 127 each, the two halves' sum < 2^15, exact in int16
                        p16 = [call_intrinsic(b, "llvm.x86.avx512.pmaddubs.w.512", vec(I16, 32), [w, x])
                               for w, x in zip((quad.lo, quad.hi), xs, strict=True)]  # fmt: skip
                        ones = ir.Constant(vec(I16, 32), [1] * 32)
                        sums = call_intrinsic(b, "llvm.x86.avx512.pmaddw.d.512", v16, [b.add(*p16), ones])
                    # lanes 4j..4j+3: block j's sums
                    scale = b.fmul(quad.scales, v.load(dps[t], index, F32, 4, align=4))
                    scale = b.shuffle_vector(scale, scale, ir.Constant(v16, [j // 4 for j in range(16)]))
                    acc = acc16[t][0]
                    b.store(v.fma(b.sitofp(sums, vec(F32, 16)), scale, b.load(acc)), acc)
                    bsum = v.load(bps[t], index, F32, 4, align=4)
                    b.store(v.fma(quad.bias, bsum, b.load(accq[t])), accq[t])
                used.update(("16", "q"))

            n_blocks = args[2]
            if layout.weights == LANES:
                start: ir.Value = ir.Constant(I64, 0)
                if quads is not None:
                    n_quads = b.udiv(n_blocks, ir.Constant(I64, 4))
                    with cgutils.for_range(b, n_quads) as loop:
                        quad_dots(b.mul(loop.index, ir.Constant(I64, 4)), quads)
                    start = b.mul(n_quads, ir.Constant(I64, 4))
                rest = b.sub(n_blocks, start)
                # One chunk per block: two blocks a pass, on two chains of FMAs, so that the next block's
                # FMA does not wait for the last one's (its latency, not the bytes, bounded the loop).
                with cgutils.for_range(b, b.udiv(rest, ir.Constant(I64, 2))) as loop:
                    even = b.add(start, b.mul(loop.index, ir.Constant(I64, 2)))
                    block_dots(even, 0)
                    block_dots(b.add(even, ir.Constant(I64, 1)), 1)
                with b.if_then(b.trunc(rest, ir.IntType(1))):  # an odd count's last block
                    block_dots(b.sub(n_blocks, ir.Constant(I64, 1)), 0)
            else:  # eight chunks a block: they alternate between the chains
                with cgutils.for_range(b, n_blocks) as loop:
                    block_dots(loop.index, 0)
            outs = []
            for t in range(nt):
                parts = [hsum(b, b.fadd(b.load(acc8[t][0]), b.load(acc8[t][1])))]
                if "16" in used:
                    parts.append(hsum(b, b.fadd(b.load(acc16[t][0]), b.load(acc16[t][1]))))
                if "b" in used:
                    parts.append(hsum(b, b.load(accb[t])))
                if "s" in used:
                    parts.append(b.load(accs[t]))
                if "q" in used:
                    parts.append(hsum(b, b.load(accq[t])))
                total = parts[0]
                for part in parts[1:]:
                    total = b.fadd(total, part)
                outs.append(total)
            return context.make_tuple(b, sig.return_type, outs) if nt > 1 else outs[0]

        if nt == 1:
            sig = types.float32(w, types.int64, types.int64, xq, dx, bs, types.int64)
        return sig, codegen

    return dot


def _int_block(v: VecBuilder, block: IntBlock, bits: int, first: ir.Value, chunk0: ir.Value, xps: list[ir.Value],
               dps: list[ir.Value], bps: list[ir.Value], acc: list[ir.Value],
               accb: list[ir.Value]) -> None:  # fmt: skip
    """One super-block's dot products with each token's activations of one scale per 256 (weights and
    xps from weight `first`, dps and bps from chunk `chunk0`): the products of each weight's integer
    with its activation and its integer scale summed over the block in int32, then one float
    multiply-add per block into acc[t] (<16 x float32>).

    int16: the weights' integers times their scales first (int16, once for all tokens; |q * s| <=
    4096), then pmaddwd: at most 16 * 4096 * 32767 < 2^31 per lane. int8: unsigned weights times
    signed activations summed in pairs (pmaddubsw; a signed weight's sign moves onto the activation;
    |pair| <= 2 * 127 * 127, no saturation), then times the scales and summed in pairs (pmaddwd)."""
    b = v.b
    chunks = block.chunks
    if bits == 16:
        ws = [b.mul(b.sext(c.q, V_I16) if c.signed else b.zext(c.q, V_I16), c.scale) for c in chunks]
    else:
        # the scale of each pair of weights, and each chunk's magnitudes, once for all tokens
        pair_scales = [b.shuffle_vector(c.scale, c.scale, ir.Constant(vec(I32, 16), list(range(0, 32, 2))))
                       for c in chunks]  # fmt: skip
        mags = [call_intrinsic(b, "llvm.abs.v32i8", V_I8, [c.q, ir.Constant(ir.IntType(1), 0)]) if c.signed else c.q
                for c in chunks]  # fmt: skip
    for t in range(len(xps)):
        terms = []
        if bits == 16:
            for c, w in enumerate(ws):
                x = v.load(xps[t], b.add(first, ir.Constant(I64, c * LANES)), I16, align=2)
                terms.append(pair_sums(b, b.mul(b.sext(w, V_I32), b.sext(x, V_I32))))  # <16 x i32>
        else:
            xs = []
            for c, chunk in enumerate(chunks):
                x = v.load(xps[t], b.add(first, ir.Constant(I64, c * LANES)), I8)
                if chunk.signed:  # x with the sign of q (0 where q is 0)
                    neg = b.icmp_signed("<", chunk.q, ir.Constant(V_I8, None))
                    x = b.select(neg, b.sub(ir.Constant(V_I8, None), x), x)
                xs.append(x)
            terms = _byte_products(v, mags, xs, pair_scales)
        n = len(terms)  # partial sums: short chains of dependent adds, not one long one
        parts = terms[:4]
        for i in range(4, n):
            parts[i % 4] = b.add(parts[i % 4], terms[i])
        while len(parts) > 1:
            parts = [b.add(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
        total = parts[0]
        if total.type.count == 8:
            total = b.shuffle_vector(total, ir.Constant(total.type, None), ir.Constant(vec(I32, 16), list(range(16))))
        scale = v.splat(b.fmul(block.d, b.load(v.at(dps[t], chunk0), align=4)), 16)
        b.store(v.fma(b.sitofp(total, vec(F32, 16)), scale, b.load(acc[t])), acc[t])
        if block.bias is not None:
            bsum = v.load(bps[t], chunk0, F32, 8, align=4)
            b.store(v.fma(block.bias, bsum, b.load(accb[t])), accb[t])


def _byte_products(v: VecBuilder, mags: list[ir.Value], xs: list[ir.Value], scales: list[ir.Value]) -> list[ir.Value]:
    """Per chunk (or pair of chunks), sum over pairs of scale * (mag * x + mag' * x'): int32 vectors."""
    b = v.b
    if _AVX512:  # two chunks per instruction
        out = []
        for c in range(0, len(mags), 2):
            cat = ir.Constant(vec(I32, 64), list(range(64)))
            pair = [b.shuffle_vector(mags[c], mags[c + 1], cat), b.shuffle_vector(xs[c], xs[c + 1], cat)]
            p16 = call_intrinsic(b, "llvm.x86.avx512.pmaddubs.w.512", vec(I16, 32), pair)
            s16 = b.shuffle_vector(scales[c], scales[c + 1], ir.Constant(V_I32, list(range(32))))
            out.append(call_intrinsic(b, "llvm.x86.avx512.pmaddw.d.512", vec(I32, 16), [p16, s16]))
        return out
    if _AVX2:
        return [call_intrinsic(b, "llvm.x86.avx2.pmadd.wd", vec(I32, 8),
                      [call_intrinsic(b, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [m, x]), s])
                for m, x, s in zip(mags, xs, scales, strict=True)]  # fmt: skip
    out = []
    for m, x, s in zip(mags, xs, scales, strict=True):
        p16 = pair_sums(b, b.mul(b.zext(m, V_I16), b.sext(x, V_I16)))  # <16 x i16>, exact
        out.append(pair_sums(b, b.mul(b.sext(p16, vec(I32, 16)), b.sext(s, vec(I32, 16)))))
    return out


def _fma1(b: ir.IRBuilder, x: ir.Value, y: ir.Value, z: ir.Value) -> ir.Value:
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(F32, [F32, F32, F32]), "llvm.fma.f32")
    return b.call(fn, [x, y, z])


TOKENS = 4  # tokens per pass over a row: each chunk of weights is unpacked once for all of them

_DECODE = {t: _decode_intrinsic(lay) for t, lay in LAYOUTS.items()}
_DOTS = {(t, nt, bits): _dot_intrinsic(lay, nt, bits) for t, lay in LAYOUTS.items() for nt in (1, TOKENS)
         for bits in (8, 16)}  # fmt: skip


def dot_row(code: int, w: np.ndarray, w_off: int, k: int, xq: np.ndarray, dx: np.ndarray, bs: np.ndarray,
            rows: Any) -> Any:  # fmt: skip
    """The row of k weights at byte w_off of w times activation rows `rows` (one int, or TOKENS of
    them in a tuple) of quantize_rows' (xq, dx, bs), int8 or int16: a float32, or a tuple of them.

    Compiled code only (see the overloads below). `code`, the type's gguf enum value, must be a
    compile-time constant: a kernel closes over it, and only that type's layout is compiled in.
    """
    raise NotImplementedError("dot_row runs in compiled code")


def decode_row(code: int, w: np.ndarray, w_off: int, k: int, y: np.ndarray, y_off: int) -> None:
    """The row of k weights at byte w_off of w, as float32 into y at byte y_off."""
    raise NotImplementedError("decode_row runs in compiled code")


# numba compares an overload's signature with its implementation's: neither has annotations.
@overload(dot_row, inline="always")
def _dot_row(code, w, w_off, k, xq, dx, bs, rows):
    qtype = literal_qtype(code)
    if qtype is None:
        return None
    per_block = LAYOUTS[qtype].weights
    nt = TOKENS if isinstance(rows, types.BaseTuple) else 1
    dot = _DOTS[qtype, nt, xq.dtype.bitwidth]

    def impl(code, w, w_off, k, xq, dx, bs, rows):
        return dot(w, w_off, k // per_block, xq, dx, bs, rows)

    return impl


@overload(decode_row, inline="always")
def _decode_row(code, w, w_off, k, y, y_off):
    qtype = literal_qtype(code)
    if qtype is None:
        return None
    per_block = LAYOUTS[qtype].weights
    decode = _DECODE[qtype]

    def impl(code, w, w_off, k, y, y_off):
        decode(w, w_off, k // per_block, y, y_off)

    return impl
