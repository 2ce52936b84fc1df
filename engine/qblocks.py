"""GGUF block layouts as vector code: one entry per quant type, compiled into the kernels.

Each entry turns one block of the file's bytes (a pointer to where it lies) into its weights as
LLVM vectors of 32 float32 lanes, in the order of the row. From that one description come the
two operations the kernels in `cpu_kernels.py` use (numba intrinsics, inlined where they are
called, so LLVM sees the whole loop and vectorizes it for the machine's CPU):

- `dot_group`: the dot product of a group of `GROUP` weights of a row with the activations,
  without storing the weights (one or two tokens per row);
- `decode_group` into a float32 buffer, then `dot_buffer` per token (more tokens per row).

Both accumulate lane-wise, `acc = fma(w, x, acc)` per 32-weight chunk in row order, then sum the
32 lanes in one fixed tree, so they give bit-identical results: how many tokens share a row never
changes a token's result. No fast-math flags on these operations, so LLVM keeps that order.

The weights follow the reference dequantizer (`engine/quants.py`, bit-exact with gguf-py) except
that a scale and a min are applied in one fused multiply-add: a weight can differ by one unit in
the last place, far inside the kernels' 1e-5 bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import llvmlite.binding as llvm
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from llvmlite import ir
from numba.core import cgutils

from .jit import intrinsic, overload, types

GROUP = 256  # weights per kernel step: one super-block, or eight 32-weight blocks
LANES = 32  # weights per vector chunk

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vec(t: ir.Type, n: int = LANES) -> ir.VectorType:
    return ir.VectorType(t, n)


V_I8, V_I32, V_F32 = _vec(I8), _vec(I32), _vec(F32)

_IQ4_NL = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
_MXFP4 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]  # doubled; the scale is halved
# x86's byte shuffle looks up 16 table entries for 16 lanes at once; elsewhere one lane at a time.
_X86 = llvm.get_process_triple().startswith(("x86_64", "amd64"))


class _B:
    """IR building shorthands over one llvmlite builder."""

    def __init__(self, b: ir.IRBuilder) -> None:
        self.b = b

    def at(self, p: ir.Value, off: int | ir.Value) -> ir.Value:
        return self.b.gep(p, [ir.Constant(I64, off) if isinstance(off, int) else off])

    def load(self, p: ir.Value, off: int | ir.Value, t: ir.Type, n: int = LANES, align: int = 1) -> ir.Value:
        return self.b.load(self.b.bitcast(self.at(p, off), _vec(t, n).as_pointer()), align=align)

    def scalar(self, p: ir.Value, off: int, t: ir.Type) -> ir.Value:
        return self.b.load(self.b.bitcast(self.at(p, off), t.as_pointer()), align=1)

    def u8(self, p: ir.Value, off: int) -> ir.Value:
        return self.b.zext(self.scalar(p, off, I8), I32)

    def f16(self, p: ir.Value, off: int) -> ir.Value:
        """A float16 as float32 with integer operations (exact, on every CPU): the magnitude's bits
        moved into float32's position are the value times 2^-112, for subnormals too."""
        h = self.b.zext(self.scalar(p, off, I16), I32)
        mag = self.b.shl(self.b.and_(h, ir.Constant(I32, 0x7FFF)), ir.Constant(I32, 13))
        is_special = self.b.icmp_unsigned("==", self.b.and_(h, ir.Constant(I32, 0x7C00)), ir.Constant(I32, 0x7C00))
        mag = self.b.select(is_special, self.b.or_(mag, ir.Constant(I32, 0x7F800000)), mag)
        v = self.b.fmul(self.b.bitcast(mag, F32), ir.Constant(F32, 2.0**112))
        sign = self.b.shl(self.b.and_(h, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16))
        return self.b.bitcast(self.b.or_(self.b.bitcast(v, I32), sign), F32)

    def splat(self, s: ir.Value, n: int = LANES) -> ir.Value:
        v = self.b.insert_element(ir.Constant(_vec(s.type, n), ir.Undefined), s, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), [0] * n))

    def const(self, t: ir.Type, values: list[int] | int) -> ir.Constant:
        return ir.Constant(_vec(t), values if isinstance(values, list) else [values] * LANES)

    def nibbles(self, p: ir.Value, off: int) -> ir.Value:
        """16 bytes at off -> 32 lanes: the low nibbles, then the high nibbles (the 32-weight blocks' order)."""
        q = self.load(p, off, I8, 16)
        lo = self.b.and_(q, ir.Constant(_vec(I8, 16), [15] * 16))
        hi = self.b.lshr(q, ir.Constant(_vec(I8, 16), [4] * 16))
        return self.b.shuffle_vector(lo, hi, ir.Constant(V_I32, list(range(LANES))))

    def bits32(self, p: ir.Value, off: int) -> ir.Value:
        """The 32 bits of a little-endian uint32 at off, one per lane, each moved to bit 4 (Q5_0/Q5_1's fifth bits)."""
        qh = self.splat(self.scalar(p, off, I32))
        bit = self.b.and_(self.b.lshr(qh, self.const(I32, list(range(LANES)))), self.const(I32, 1))
        return self.b.shl(self.b.trunc(bit, V_I8), self.const(I8, 4))

    def signed(self, q: ir.Value, offset: int) -> ir.Value:
        return self.b.sitofp(self.b.sub(q, self.const(I8, offset)), V_F32)

    def unsigned(self, q: ir.Value) -> ir.Value:
        return self.b.uitofp(q, V_F32)

    def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        t = a.type
        name = f"llvm.fma.v{t.count}f32"
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(t, [t, t, t]), name)
        return self.b.call(fn, [a, b, c])

    def table(self, idx: ir.Value, values: list[int]) -> ir.Value:
        """Lanes idx (0..15) looked up in a 16-entry int8 table, as float32."""
        if _X86:
            fnty = ir.FunctionType(_vec(I8, 16), [_vec(I8, 16), _vec(I8, 16)])
            fn = cgutils.get_or_insert_function(self.b.module, fnty, "llvm.x86.ssse3.pshuf.b.128")
            tab = ir.Constant(_vec(I8, 16), values)
            halves = []
            for h in range(2):
                part = self.b.shuffle_vector(idx, idx, ir.Constant(_vec(I32, 16), list(range(16 * h, 16 * h + 16))))
                halves.append(self.b.call(fn, [tab, part]))
            out = self.b.shuffle_vector(halves[0], halves[1], ir.Constant(V_I32, list(range(LANES))))
        else:
            tab = ir.Constant(_vec(I8, 16), values)
            out = ir.Constant(V_I8, ir.Undefined)
            for lane in range(LANES):
                i = self.b.extract_element(idx, ir.Constant(I32, lane))
                out = self.b.insert_element(out, self.b.extract_element(tab, i), ir.Constant(I32, lane))
        return self.b.sitofp(out, V_F32)


Chunks = Callable[[_B, ir.Value], Iterable[ir.Value]]  # emitted one at a time, each used before the next


# -- 32-weight blocks: one chunk each ------------------------------------------------------------


def _q4_0(v: _B, p: ir.Value) -> list[ir.Value]:
    return [v.b.fmul(v.signed(v.nibbles(p, 2), 8), v.splat(v.f16(p, 0)))]


def _q4_1(v: _B, p: ir.Value) -> list[ir.Value]:
    return [v.fma(v.unsigned(v.nibbles(p, 4)), v.splat(v.f16(p, 0)), v.splat(v.f16(p, 2)))]


def _q5_0(v: _B, p: ir.Value) -> list[ir.Value]:
    q = v.b.or_(v.nibbles(p, 6), v.bits32(p, 2))
    return [v.b.fmul(v.signed(q, 16), v.splat(v.f16(p, 0)))]


def _q5_1(v: _B, p: ir.Value) -> list[ir.Value]:
    q = v.b.or_(v.nibbles(p, 8), v.bits32(p, 4))
    return [v.fma(v.unsigned(q), v.splat(v.f16(p, 0)), v.splat(v.f16(p, 2)))]


def _q8_0(v: _B, p: ir.Value) -> list[ir.Value]:
    return [v.b.fmul(v.b.sitofp(v.load(p, 2, I8), V_F32), v.splat(v.f16(p, 0)))]


def _iq4_nl(v: _B, p: ir.Value) -> list[ir.Value]:
    return [v.b.fmul(v.table(v.nibbles(p, 2), _IQ4_NL), v.splat(v.f16(p, 0)))]


def _mxfp4(v: _B, p: ir.Value) -> list[ir.Value]:
    # E8M0 scale 2^(e - 127), halved for the doubled code book: the float32 with exponent bits e - 1.
    b = v.b
    e = b.zext(v.scalar(p, 0, I8), I32)
    normal = b.shl(b.sub(e, ir.Constant(I32, 1)), ir.Constant(I32, 23))
    subnormal = b.shl(ir.Constant(I32, 0x200000), e)  # e = 0, 1: 2^-128, 2^-127
    d = b.bitcast(b.select(b.icmp_unsigned(">=", e, ir.Constant(I32, 2)), normal, subnormal), F32)
    return [v.b.fmul(v.table(v.nibbles(p, 1), _MXFP4), v.splat(d))]


# -- 256-weight super-blocks: eight chunks each --------------------------------------------------


def _k_scales(v: _B, p: ir.Value) -> tuple[list[ir.Value], list[ir.Value]]:
    """Q4_K/Q5_K: per 32-weight sub-block, scale * d and min * dmin from the 12 packed bytes at 4."""
    d, dmin = v.f16(p, 0), v.f16(p, 2)
    scales, mins = [], []
    b = v.b

    def c(n: int) -> ir.Constant:
        return ir.Constant(I32, n)

    for j in range(8):
        if j < 4:
            sc, mn = b.and_(v.u8(p, 4 + j), c(63)), b.and_(v.u8(p, 8 + j), c(63))
        else:  # low 4 bits in bytes 8..11, high 2 bits in the top of bytes 0..3 (scales) and 4..7 (mins)
            sc = b.or_(b.and_(v.u8(p, 8 + j), c(15)), b.shl(b.lshr(v.u8(p, j), c(6)), c(4)))
            mn = b.or_(b.lshr(v.u8(p, 8 + j), c(4)), b.shl(b.lshr(v.u8(p, 4 + j), c(6)), c(4)))
        scales.append(b.fmul(d, b.uitofp(sc, F32)))
        mins.append(b.fneg(b.fmul(dmin, b.uitofp(mn, F32))))
    return scales, mins


def _q4_k(v: _B, p: ir.Value) -> Iterator[ir.Value]:
    scales, mins = _k_scales(v, p)
    for c in range(4):
        q = v.load(p, 16 + 32 * c, I8)
        for half, nib in enumerate((v.b.and_(q, v.const(I8, 15)), v.b.lshr(q, v.const(I8, 4)))):
            j = 2 * c + half
            yield v.fma(v.unsigned(nib), v.splat(scales[j]), v.splat(mins[j]))


def _q5_k(v: _B, p: ir.Value) -> Iterator[ir.Value]:
    scales, mins = _k_scales(v, p)
    qh = v.load(p, 16, I8)
    for c in range(4):
        q = v.load(p, 48 + 32 * c, I8)
        for half, nib in enumerate((v.b.and_(q, v.const(I8, 15)), v.b.lshr(q, v.const(I8, 4)))):
            j = 2 * c + half
            high = v.b.shl(v.b.and_(v.b.lshr(qh, v.const(I8, j)), v.const(I8, 1)), v.const(I8, 4))
            yield v.fma(v.unsigned(v.b.or_(nib, high)), v.splat(scales[j]), v.splat(mins[j]))


def _q6_k(v: _B, p: ir.Value) -> Iterator[ir.Value]:
    d = v.f16(p, 208)
    b = v.b
    sc = b.fmul(b.sitofp(v.load(p, 192, I8, 16), _vec(F32, 16)), v.splat(d, 16))  # 16 scales, each over 16 weights
    for half in range(2):
        lo, hi, qh = v.load(p, 64 * half, I8), v.load(p, 64 * half + 32, I8), v.load(p, 128 + 32 * half, I8)
        # Each (lo, hi, qh) byte triple holds one weight of each 32-weight quarter of this half.
        for quarter, (src, shift) in enumerate(((lo, 0), (hi, 0), (lo, 4), (hi, 4))):
            low = b.and_(b.lshr(src, v.const(I8, shift)), v.const(I8, 15))
            high = b.shl(b.and_(b.lshr(qh, v.const(I8, 2 * quarter)), v.const(I8, 3)), v.const(I8, 4))
            s = 8 * half + 2 * quarter  # scales s and s + 1: the chunk's two runs of 16
            scale = b.shuffle_vector(sc, sc, ir.Constant(V_I32, [s] * 16 + [s + 1] * 16))
            yield b.fmul(v.signed(b.or_(low, high), 32), scale)


def _iq4_xs(v: _B, p: ir.Value) -> Iterator[ir.Value]:
    d = v.f16(p, 0)
    b = v.b
    sh = b.zext(v.scalar(p, 2, I16), I32)
    for ib in range(8):
        low = b.and_(b.lshr(v.u8(p, 4 + ib // 2), ir.Constant(I32, 4 * (ib % 2))), ir.Constant(I32, 15))
        high = b.shl(b.and_(b.lshr(sh, ir.Constant(I32, 2 * ib)), ir.Constant(I32, 3)), ir.Constant(I32, 4))
        dl = b.fmul(d, b.sitofp(b.sub(b.or_(low, high), ir.Constant(I32, 32)), F32))
        yield b.fmul(v.table(v.nibbles(p, 8 + 16 * ib), _IQ4_NL), v.splat(dl))


@dataclass(frozen=True)
class Layout:
    weights: int  # per block
    size: int  # bytes per block
    chunks: Chunks  # a block's weights, 32 lanes per chunk


def _layout(qtype: Q, chunks: Chunks) -> Layout:
    weights, size = GGML_QUANT_SIZES[qtype]
    return Layout(weights, size, chunks)


# The registry: one entry per quant type, its whole block layout.
LAYOUTS: dict[Q, Layout] = {
    t: _layout(t, fn)
    for t, fn in (
        (Q.Q4_0, _q4_0), (Q.Q4_1, _q4_1), (Q.Q5_0, _q5_0), (Q.Q5_1, _q5_1), (Q.Q8_0, _q8_0),
        (Q.IQ4_NL, _iq4_nl), (Q.MXFP4, _mxfp4), (Q.Q4_K, _q4_k), (Q.Q5_K, _q5_k), (Q.Q6_K, _q6_k),
        (Q.IQ4_XS, _iq4_xs),
    )
}  # fmt: skip


def has_kernel(qtype: Q) -> bool:
    return qtype in LAYOUTS


# -- intrinsics ----------------------------------------------------------------------------------


def _data(context: Any, builder: ir.IRBuilder, aty: Any, arr: ir.Value, byte_off: ir.Value) -> ir.Value:
    """An i8* to byte `byte_off` of an array's data."""
    data = context.make_array(aty)(context, builder, arr).data
    return builder.gep(builder.bitcast(data, I8.as_pointer()), [byte_off])


def _hsum(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """The lanes' sum in one fixed tree (halves added pairwise)."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), list(range(n))))
        hi = b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), list(range(n, 2 * n))))
        v = b.fadd(lo, hi)
    return b.extract_element(v, ir.Constant(I32, 0))


def _each_chunk(
    v: _B, layout: Layout, n_blocks: ir.Value, wp: ir.Value, fp: ir.Value, each: Callable[[ir.Value, ir.Value], None]
) -> None:
    """each(weights, place) for every chunk of the n_blocks blocks at wp, in row order; `place` is
    the chunk's float32 pointer in the row of floats at fp (activations to multiply, or a buffer)."""
    b = v.b
    with cgutils.for_range(b, n_blocks) as loop:
        block = v.at(wp, b.mul(loop.index, ir.Constant(I64, layout.size)))
        row = v.at(fp, b.mul(loop.index, ir.Constant(I64, layout.weights)))
        for c, wv in enumerate(layout.chunks(v, block)):
            each(wv, v.at(row, c * LANES))


def _dot_intrinsic(layout: Layout) -> Any:
    @intrinsic
    def dot(typingctx, w, w_off, n_blocks, x, x_off):  # numba's signature: no annotations
        """sum over n_blocks blocks at byte w_off of w of weights * x, x from byte x_off of x."""
        sig = types.float32(w, types.int64, types.int64, x, types.int64)

        def codegen(context, builder, sig, args):
            v = _B(builder)
            wp = _data(context, builder, sig.args[0], args[0], args[1])
            xp = builder.bitcast(_data(context, builder, sig.args[3], args[3], args[4]), F32.as_pointer())
            acc = cgutils.alloca_once_value(builder, ir.Constant(V_F32, None))

            def accumulate(wv: ir.Value, place: ir.Value) -> None:
                builder.store(v.fma(wv, v.load(place, 0, F32, align=4), builder.load(acc)), acc)

            _each_chunk(v, layout, args[2], wp, xp, accumulate)
            return _hsum(builder, builder.load(acc))

        return sig, codegen

    return dot


def _decode_intrinsic(layout: Layout) -> Any:
    @intrinsic
    def decode(typingctx, w, w_off, n_blocks, y, y_off):
        """n_blocks blocks at byte w_off of w -> their weights at byte y_off of y."""
        sig = types.void(w, types.int64, types.int64, y, types.int64)

        def codegen(context, builder, sig, args):
            v = _B(builder)
            wp = _data(context, builder, sig.args[0], args[0], args[1])
            yp = builder.bitcast(_data(context, builder, sig.args[3], args[3], args[4]), F32.as_pointer())

            def store(wv: ir.Value, place: ir.Value) -> None:
                builder.store(wv, builder.bitcast(place, V_F32.as_pointer()), align=4)

            _each_chunk(v, layout, args[2], wp, yp, store)
            return context.get_dummy_value()

        return sig, codegen

    return decode


TOKENS = 4  # tokens per pass over a decoded buffer: each chunk of weights is loaded once for all of them


def _dot_buffer(typingctx, y, n, x, x_offs):
    """For each of TOKENS byte offsets o in x_offs: sum(y[:n] * x at o), n a multiple of 32, accumulated
    lane-wise in chunk order as `dot_group` does (the same result for a token, bit for bit)."""
    sig = types.UniTuple(types.float32, TOKENS)(y, types.int64, x, x_offs)

    def codegen(context, builder, sig, args):
        v = _B(builder)
        yp = builder.bitcast(_data(context, builder, sig.args[0], args[0], ir.Constant(I64, 0)), F32.as_pointer())
        offs = cgutils.unpack_tuple(builder, args[3], TOKENS)
        xps = [builder.bitcast(_data(context, builder, sig.args[2], args[2], o), F32.as_pointer()) for o in offs]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V_F32, None)) for _ in range(TOKENS)]
        with cgutils.for_range(builder, builder.udiv(args[1], ir.Constant(I64, LANES))) as loop:
            off = builder.mul(loop.index, ir.Constant(I64, LANES))
            wv = v.load(yp, off, F32, align=4)
            for xp, acc in zip(xps, accs, strict=True):
                builder.store(v.fma(wv, v.load(xp, off, F32, align=4), builder.load(acc)), acc)
        sums = [_hsum(builder, builder.load(acc)) for acc in accs]
        return context.make_tuple(builder, sig.return_type, sums)

    return sig, codegen


dot_buffer: Any = intrinsic(_dot_buffer)


_DOT = {t: _dot_intrinsic(lay) for t, lay in LAYOUTS.items()}
_DECODE = {t: _decode_intrinsic(lay) for t, lay in LAYOUTS.items()}


def _group_blocks(code: Any) -> tuple[int, int, Any, Any] | None:
    """For a constant type code: (weights per block, bytes per GROUP weights, its dot, its decode)."""
    if not isinstance(code, types.IntegerLiteral):
        return None  # numba retries with the constant's literal type
    qtype = Q(code.literal_value)
    layout = LAYOUTS[qtype]
    return layout.weights, GROUP // layout.weights * layout.size, _DOT[qtype], _DECODE[qtype]


def dot_group(code: int, w: np.ndarray, w_off: int, g: int, k: int, x: np.ndarray, x_off: int) -> np.float32:
    """Weights g*GROUP.. of the row of k weights at byte w_off of w, times x from byte x_off of x.

    Compiled code only (see the overloads below). `code`, the type's gguf enum value, must be a
    compile-time constant: a kernel closes over it, and only that type's layout is compiled in.
    """
    raise NotImplementedError("dot_group runs in compiled code")


def decode_group(code: int, w: np.ndarray, w_off: int, g: int, k: int, y: np.ndarray, y_off: int) -> int:
    """Weights g*GROUP.. of the row of k weights at byte w_off of w, into y at byte y_off; returns how many."""
    raise NotImplementedError("decode_group runs in compiled code")


# numba compares an overload's signature with its implementation's: neither has annotations.
@overload(dot_group, inline="always")
def _dot_group(code, w, w_off, g, k, x, x_off):
    found = _group_blocks(code)
    if found is None:
        return None
    weights, group_bytes, dot, _ = found

    def impl(code, w, w_off, g, k, x, x_off):
        n = min(GROUP, k - g * GROUP)
        return dot(w, w_off + g * group_bytes, n // weights, x, x_off + 4 * g * GROUP)

    return impl


@overload(decode_group, inline="always")
def _decode_group(code, w, w_off, g, k, y, y_off):
    found = _group_blocks(code)
    if found is None:
        return None
    weights, group_bytes, _, decode = found

    def impl(code, w, w_off, g, k, y, y_off):
        n = min(GROUP, k - g * GROUP)
        decode(w, w_off + g * group_bytes, n // weights, y, y_off)
        return n

    return impl
