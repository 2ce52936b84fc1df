"""LLVM IR shorthands the CPU kernels build their vector code with (numba intrinsics, llvmlite IR).

The lane counts and types of a 32-weight chunk, a builder of the loads, splats, nibble unpacks,
table lookups and fused multiply-adds every block layout needs (`VecBuilder`), the reductions in one
fixed order (`hsum`: a dot product's bits do not depend on who sums), a pointer into an array's
bytes, a call of a named LLVM intrinsic, and a quant type read from a compile-time constant.
`qblocks` (the block layouts), `qtiles`, `qtiles8` and `attention_core` share them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llvmlite.binding as llvm
from gguf import GGMLQuantizationType as Q
from llvmlite import ir
from numba.core import cgutils

from . import isa
from .jit import types

LANES = 32  # weights per vector chunk

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def vec(t: ir.Type, n: int = LANES) -> ir.VectorType:
    return ir.VectorType(t, n)


V_I8, V_I16, V_I32, V_F32, V8_F32 = vec(I8), vec(I16), vec(I32), vec(F32), vec(F32, 8)

# A float16 converts in one instruction with x86's F16C or on ARM; elsewhere with integer operations.
HALF = (llvm.get_process_triple().startswith(("x86_64", "amd64")) and bool(llvm.get_host_cpu_features().get("f16c"))
         ) or llvm.get_process_triple().startswith(("aarch64", "arm64"))  # fmt: skip


class VecBuilder:
    """IR building shorthands over one llvmlite builder."""

    def __init__(self, b: ir.IRBuilder) -> None:
        self.b = b

    def at(self, p: ir.Value, off: int | ir.Value) -> ir.Value:
        return self.b.gep(p, [ir.Constant(I64, off) if isinstance(off, int) else off])

    def load(self, p: ir.Value, off: int | ir.Value, t: ir.Type, n: int = LANES, align: int = 1) -> ir.Value:
        return self.b.load(self.b.bitcast(self.at(p, off), vec(t, n).as_pointer()), align=align)

    def scalar(self, p: ir.Value, off: int, t: ir.Type) -> ir.Value:
        return self.b.load(self.b.bitcast(self.at(p, off), t.as_pointer()), align=1)

    def u8(self, p: ir.Value, off: int) -> ir.Value:
        return self.b.zext(self.scalar(p, off, I8), I32)

    def f16(self, p: ir.Value, off: int) -> ir.Value:
        """A float16 as float32 (exact)."""
        if HALF:
            return self.b.fpext(self.scalar(p, off, ir.HalfType()), F32)
        # With integer operations: the magnitude's bits moved into float32's position are the value
        # times 2^-112, for subnormals too.
        h = self.b.zext(self.scalar(p, off, I16), I32)
        mag = self.b.shl(self.b.and_(h, ir.Constant(I32, 0x7FFF)), ir.Constant(I32, 13))
        is_special = self.b.icmp_unsigned("==", self.b.and_(h, ir.Constant(I32, 0x7C00)), ir.Constant(I32, 0x7C00))
        mag = self.b.select(is_special, self.b.or_(mag, ir.Constant(I32, 0x7F800000)), mag)
        v = self.b.fmul(self.b.bitcast(mag, F32), ir.Constant(F32, 2.0**112))
        sign = self.b.shl(self.b.and_(h, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16))
        return self.b.bitcast(self.b.or_(self.b.bitcast(v, I32), sign), F32)

    def splat(self, s: ir.Value, n: int = LANES) -> ir.Value:
        v = self.b.insert_element(ir.Constant(vec(s.type, n), ir.Undefined), s, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, v, ir.Constant(vec(I32, n), [0] * n))

    def const(self, t: ir.Type, values: list[int] | int) -> ir.Constant:
        return ir.Constant(vec(t), values if isinstance(values, list) else [values] * LANES)

    def nibbles(self, p: ir.Value, off: int) -> ir.Value:
        """16 bytes at off -> 32 lanes: the low nibbles, then the high nibbles (the 32-weight blocks' order)."""
        q = self.load(p, off, I8, 16)
        lo = self.b.and_(q, ir.Constant(vec(I8, 16), [15] * 16))
        hi = self.b.lshr(q, ir.Constant(vec(I8, 16), [4] * 16))
        return self.b.shuffle_vector(lo, hi, ir.Constant(V_I32, list(range(LANES))))

    def bits32(self, p: ir.Value, off: int) -> ir.Value:
        """The 32 bits of a little-endian uint32 at off, one per lane, each moved to bit 4 (Q5_0/Q5_1's fifth bits)."""
        qh = self.splat(self.scalar(p, off, I32))
        bit = self.b.and_(self.b.lshr(qh, self.const(I32, list(range(LANES)))), self.const(I32, 1))
        return self.b.shl(self.b.trunc(bit, V_I8), self.const(I8, 4))

    def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        t = a.type
        name = f"llvm.fma.v{t.count}f32"
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(t, [t, t, t]), name)
        return self.b.call(fn, [a, b, c])

    def table(self, idx: ir.Value, values: list[int]) -> ir.Value:
        """Lanes idx (0..15) looked up in a 16-entry int8 table."""
        if isa.AVX2:  # one 32-byte shuffle: each 16-byte half looks up its own copy of the table
            return call_intrinsic(self.b, "llvm.x86.avx2.pshuf.b", V_I8, [ir.Constant(V_I8, values * 2), idx])
        if isa.X86:  # x86's byte shuffle: 16 table entries for 16 lanes at once
            fnty = ir.FunctionType(vec(I8, 16), [vec(I8, 16), vec(I8, 16)])
            fn = cgutils.get_or_insert_function(self.b.module, fnty, "llvm.x86.ssse3.pshuf.b.128")
            tab = ir.Constant(vec(I8, 16), values)
            halves = []
            for h in range(2):
                part = self.b.shuffle_vector(idx, idx, ir.Constant(vec(I32, 16), list(range(16 * h, 16 * h + 16))))
                halves.append(self.b.call(fn, [tab, part]))
            out = self.b.shuffle_vector(halves[0], halves[1], ir.Constant(V_I32, list(range(LANES))))
        else:
            tab = ir.Constant(vec(I8, 16), values)
            out = ir.Constant(V_I8, ir.Undefined)
            for lane in range(LANES):
                i = self.b.extract_element(idx, ir.Constant(I32, lane))
                out = self.b.insert_element(out, self.b.extract_element(tab, i), ir.Constant(I32, lane))
        return out


def byte_ptr(context: Any, builder: ir.IRBuilder, aty: Any, arr: ir.Value, byte_off: ir.Value) -> ir.Value:
    """An i8* to byte `byte_off` of an array's data."""
    data = context.make_array(aty)(context, builder, arr).data
    return builder.gep(builder.bitcast(data, I8.as_pointer()), [byte_off])


def row_ptr(context: Any, b: ir.IRBuilder, aty: Any, arr: ir.Value, row: ir.Value, t: ir.Type) -> ir.Value:
    """A t* to the first element of row `row` of a 2-D array."""
    a = context.make_array(aty)(context, b, arr)
    stride = cgutils.unpack_tuple(b, a.strides, 2)[0]
    return b.bitcast(b.gep(b.bitcast(a.data, I8.as_pointer()), [b.mul(row, stride)]), t.as_pointer())


def lanes_reduced(b: ir.IRBuilder, v: ir.Value, op: Callable[[ir.Value, ir.Value], ir.Value]) -> ir.Value:
    """The lanes of v combined by op, halves pairwise: for an exact op (integer add, maximum) the order
    does not show."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = b.shuffle_vector(v, v, ir.Constant(vec(I32, n), list(range(n))))
        hi = b.shuffle_vector(v, v, ir.Constant(vec(I32, n), list(range(n, 2 * n))))
        v = op(lo, hi)
    return b.extract_element(v, ir.Constant(I32, 0))


def hsum(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """The lanes' sum in one fixed tree (halves added pairwise)."""
    return lanes_reduced(b, v, b.fadd)


def pair_sums(b: ir.IRBuilder, m: ir.Value) -> ir.Value:
    """Adjacent lanes summed: n lanes -> n / 2."""
    n = m.type.count
    even = b.shuffle_vector(m, m, ir.Constant(vec(I32, n // 2), list(range(0, n, 2))))
    odd = b.shuffle_vector(m, m, ir.Constant(vec(I32, n // 2), list(range(1, n, 2))))
    return b.add(even, odd)


def call_intrinsic(b: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return b.call(fn, args)


def literal_qtype(code: Any) -> Q | None:
    """The quant type of a constant type code (None: numba retries with the constant's literal type)."""
    return Q(code.literal_value) if isinstance(code, types.IntegerLiteral) else None
