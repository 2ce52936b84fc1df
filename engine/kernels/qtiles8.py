"""A prompt's super-block tiles with int8 activations, on AVX512-VNNI: 64 byte products an instruction.

`qtiles` multiplies int16 activations by int16 weights (each integer times its sub-block scale):
32 products an instruction, its port's limit. Here the weights stay bytes and the sub-block scales
are applied once per 16 weights after the byte products (vpdpbusd), so a super-block takes four
product instructions per (row, token) where int16 takes eight.

For that, each of vpdpbusd's 16 lanes must hold one sub-block's products. Both operands are laid out
per super-block so that lane l of pass c holds weights 16l + 4c .. 16l + 4c + 3 (`ORDER`): after
the four passes lane l holds the sum over the weights 16l .. 16l + 15, which share one integer scale
(sub-blocks of 16 or 32 weights). vpdpbusd multiplies unsigned by signed bytes: the activations
go in as x + 128 (1..255) and the weights as signed bytes, and each lane starts from -128 times its
weights' sum (one vector per row and super-block, made when the row is unpacked), so the lane ends
with the sum of x * q. Then, per (row, token) and super-block: the lanes times their scales (int32),
to float, times d * dx, into sixteen float sums; the blocks' biases (the K-quants' mins) times the
activations' sums as in `qtiles`.

The integers are the int8 dot products' (`dot_row` with bits=8 and the same activations, one scale
per 256); only the order of the float sums differs, so results agree with dot_row's within float32
rounding (the tests hold them to 1e-5 of the largest).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from llvmlite import ir
from numba.core import cgutils

from . import isa
from .jit import intrinsic, njit, overload, prange, types
from .llvm_ir import F32, I8, I32, I64, LANES, V8_F32, VecBuilder, byte_ptr, call_intrinsic, literal_qtype, row_ptr, vec
from .qblocks import LAYOUTS, SUPER
from .qtiles import PAIRS, TILE_ROWS, TILE_TOKENS, Group, Pair, has_bias, tile_loop

PASSES = SUPER // 64  # vpdpbusd passes per super-block
GROUPS = 16  # lanes: groups of 16 weights
V16_I32 = vec(I32, GROUPS)
V16_F32 = vec(F32, GROUPS)
V64_I8 = vec(I8, 64)
# ORDER[c * 64 + 4 * lane + b]: the weight (within its super-block) in byte b of that lane in pass c
ORDER = np.array([16 * lane + 4 * c + b for c in range(PASSES) for lane in range(GROUPS) for b in range(4)], np.int64)


def tiled8(qtype: Q) -> bool:
    """Whether int8 tiles read this type here: a super-block type, on a CPU with AVX512-VNNI."""
    return isa.VNNI and qtype in LAYOUTS and LAYOUTS[qtype].ints is not None


def _unpack8_intrinsic(qtype: Q) -> Any:
    layout = LAYOUTS[qtype]
    ints = layout.ints
    assert ints is not None

    @intrinsic
    def unpack(typingctx, w, w_off, n_blocks, ws, wsc, wcor, wd, wb, r):
        """n_blocks super-blocks at byte w_off of w -> row r of ws (the weights' signed bytes, in
        ORDER), wsc (each lane's integer scale), wcor (each lane's start: -128 times its weights'
        sum), wd (each block's d), wb (each chunk's bias; left alone for types without one)."""
        sig = types.void(w, types.int64, types.int64, ws, wsc, wcor, wd, wb, types.int64)

        def codegen(context, builder, sig, args):
            v, b = VecBuilder(builder), builder
            wp = byte_ptr(context, b, sig.args[0], args[0], args[1])
            wsp, scp, corp, wdp, wbp = (row_ptr(context, b, sig.args[i], args[i], args[8], t)
                                        for i, t in ((3, I8), (4, I32), (5, I32), (6, F32), (7, F32)))  # fmt: skip
            cat2 = ir.Constant(vec(I32, 64), list(range(64)))
            cat4 = ir.Constant(vec(I32, 128), list(range(128)))
            with cgutils.for_range(b, args[2]) as loop:
                i = loop.index
                block = ints(v, v.at(wp, b.mul(i, ir.Constant(I64, layout.size))))
                qs = [c.q for c in block.chunks]  # 8 x <32 x i8>
                halves = [b.shuffle_vector(qs[j], qs[j + 1], cat2) for j in range(0, 8, 2)]  # 4 x <64 x i8>
                quarters = [b.shuffle_vector(halves[j], halves[j + 1], cat4) for j in (0, 2)]  # 2 x <128 x i8>
                whole = b.shuffle_vector(quarters[0], quarters[1], ir.Constant(vec(I32, 256), list(range(256))))
                first = b.mul(i, ir.Constant(I64, SUPER))
                for c in range(PASSES):
                    mask = ir.Constant(vec(I32, 64), [int(o) for o in ORDER[64 * c : 64 * c + 64]])
                    dst = v.at(wsp, b.add(first, ir.Constant(I64, 64 * c)))
                    b.store(b.shuffle_vector(whole, whole, mask), b.bitcast(dst, V64_I8.as_pointer()), align=1)
                sc = ir.Constant(V16_I32, None)
                cor = ir.Constant(V16_I32, None)
                for lane in range(GROUPS):
                    chunk = block.chunks[lane // 2]
                    h = 16 * (lane % 2)
                    s = b.sext(b.extract_element(chunk.scale, ir.Constant(I32, h)), I32)
                    sc = b.insert_element(sc, s, ir.Constant(I32, lane))
                    part = b.shuffle_vector(chunk.q, chunk.q, ir.Constant(vec(I32, 16), list(range(h, h + 16))))
                    wide = b.sext(part, vec(I32, 16))
                    total = call_intrinsic(b, "llvm.vector.reduce.add.v16i32", I32, [wide])
                    cor = b.insert_element(cor, b.mul(total, ir.Constant(I32, -128)), ir.Constant(I32, lane))
                lanes0 = b.mul(i, ir.Constant(I64, GROUPS))
                b.store(sc, b.bitcast(v.at(scp, lanes0), V16_I32.as_pointer()), align=4)
                b.store(cor, b.bitcast(v.at(corp, lanes0), V16_I32.as_pointer()), align=4)
                b.store(block.d, v.at(wdp, i), align=4)
                if block.bias is not None:
                    dst = b.bitcast(v.at(wbp, b.mul(i, ir.Constant(I64, SUPER // LANES))), V8_F32.as_pointer())
                    b.store(block.bias, dst, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return unpack


def _tile8_intrinsic(qtype: Q) -> Any:
    n_r, bias = TILE_ROWS, has_bias(qtype)
    chunks = SUPER // LANES

    @intrinsic
    def tiles(typingctx, ws, wsc, wcor, wd, wb, n_blocks, xp, dx, bs, koff, a_in, c0, nc, out):
        """The scratch's TILE_ROWS rows times activation rows a_in[c0 + j], j < nc (>= TILE_TOKENS), of
        `ordered` (xp) and quantize_rows' int8 scales (dx, bs: the per-256 ones from column koff)
        -> out[j, row], TILE_TOKENS tokens at a time (`qtiles.tile_loop`)."""
        sig = types.void(ws, wsc, wcor, wd, wb, types.int64, xp, dx, bs, types.int64, a_in, types.int64,
                         types.int64, out)  # fmt: skip

        def codegen(context, builder, sig, args):
            v, b = VecBuilder(builder), builder
            i64 = functools.partial(ir.Constant, I64)
            n_blocks, koff = args[5], args[9]
            wsp, scp, corp, wdp, wbp = ([row_ptr(context, b, sig.args[i], args[i], i64(r), t) for r in range(n_r)]
                                        for i, t in ((0, I8), (1, I32), (2, I32), (3, F32), (4, F32)))  # fmt: skip

            def group(tokens: list[ir.Value]) -> Group:
                xps = [row_ptr(context, b, sig.args[6], args[6], tok, I8) for tok in tokens]
                dps, bps = ([v.at(row_ptr(context, b, sig.args[i], args[i], tok, F32), koff) for tok in tokens]
                            for i in (7, 8))  # fmt: skip

                def products(acc: dict[Pair, ir.Value]) -> None:
                    with cgutils.for_range(b, n_blocks) as loop:
                        first = b.mul(loop.index, i64(SUPER))
                        lanes0 = b.mul(loop.index, i64(GROUPS))
                        cors = [v.load(p, lanes0, I32, GROUPS, align=4) for p in corp]
                        sums = {(r, t): cors[r] for r, t in PAIRS}
                        for c in range(PASSES):
                            off = b.add(first, i64(64 * c))
                            wv = [b.bitcast(v.load(p, off, I8, 64), V16_I32) for p in wsp]
                            xv = [b.bitcast(v.load(p, off, I8, 64), V16_I32) for p in xps]
                            for r, t in PAIRS:  # unsigned activations, signed weights
                                sums[r, t] = call_intrinsic(
                                    b, "llvm.x86.avx512.vpdpbusd.512", V16_I32, [sums[r, t], xv[t], wv[r]]
                                )
                        chunk0 = b.mul(loop.index, i64(chunks))
                        for r in range(n_r):
                            sc = v.load(scp[r], lanes0, I32, GROUPS, align=4)
                            d = b.load(v.at(wdp[r], loop.index), align=4)
                            for t in range(TILE_TOKENS):
                                scale = v.splat(b.fmul(d, b.load(v.at(dps[t], chunk0), align=4)), GROUPS)
                                whole = b.sitofp(b.mul(sums[r, t], sc), V16_F32)
                                b.store(v.fma(whole, scale, b.load(acc[r, t])), acc[r, t])

                return Group(products, bias_sums=bps)

            tile_loop(context, b, sig, args, a_in=10, c0=args[11], nc=args[12], out=13, n_blocks=n_blocks,
                      bias_rows=wbp if bias else None, group=group, dot_row_sums=False)  # fmt: skip
            return context.get_dummy_value()

        return sig, codegen

    return tiles


_UNPACK8 = {t: _unpack8_intrinsic(t) for t, lay in LAYOUTS.items() if lay.ints is not None} if isa.VNNI else {}
_TILE8 = {t: _tile8_intrinsic(t) for t in _UNPACK8}


@njit(parallel=True)
def _ordered(xq: np.ndarray, rows: np.ndarray, k: int, out: np.ndarray) -> None:
    for i in prange(rows.shape[0]):
        r = rows[i]
        for s in range(0, k, SUPER):
            for p in range(SUPER):
                out[r, s + p] = np.uint8(np.int32(xq[r, k + s + ORDER[p]]) + 128)


def ordered(xq: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """quantize_rows' int8 activations with one scale per 256 (columns k..2k of xq) as the tiles read
    them: x + 128 as unsigned bytes, each super-block in ORDER. Rows not in `rows` are left unset.
    Compiled code only."""
    raise NotImplementedError("ordered runs in compiled code")


@overload(ordered, inline="always")
def _ordered_overload(xq, rows, k):
    def impl(xq, rows, k):
        out = np.empty((xq.shape[0], k), np.uint8)
        _ordered(xq, rows, k, out)
        return out

    return impl


def scratch8(k: int) -> tuple[np.ndarray, ...]:
    """Room for TILE_ROWS rows of k weights unpacked for the int8 tiles: (ws, wsc, wcor, wd, wb)."""
    raise NotImplementedError("scratch8 runs in compiled code")


def unpack_row8(code: int, w: np.ndarray, w_off: int, k: int, sc: Any, r: int) -> None:
    """The row of k weights at byte w_off of w into row r of a scratch8. Compiled code only."""
    raise NotImplementedError("unpack_row8 runs in compiled code")


def tile_dots8(code: int, sc: Any, k: int, xp: np.ndarray, dx: np.ndarray, bs: np.ndarray, a_in: np.ndarray,
               c0: int, nc: int, out: np.ndarray) -> None:  # fmt: skip
    """The scratch's TILE_ROWS rows times activation rows a_in[c0 + j], j < nc (>= TILE_TOKENS), of
    `ordered` and quantize_rows' int8 scales -> out[j, row]. Compiled code only."""
    raise NotImplementedError("tile_dots8 runs in compiled code")


@overload(scratch8, inline="always")
def _scratch8(k):
    def impl(k):
        n_blocks = k // SUPER
        return (np.empty((TILE_ROWS, k), np.int8), np.empty((TILE_ROWS, n_blocks * GROUPS), np.int32),
                np.empty((TILE_ROWS, n_blocks * GROUPS), np.int32), np.empty((TILE_ROWS, n_blocks), np.float32),
                np.zeros((TILE_ROWS, n_blocks * (SUPER // LANES)), np.float32))  # fmt: skip

    return impl


@overload(unpack_row8, inline="always")
def _unpack_row8(code, w, w_off, k, sc, r):
    qtype = literal_qtype(code)
    if qtype not in _UNPACK8:
        return None
    unpack = _UNPACK8[qtype]

    def impl(code, w, w_off, k, sc, r):
        unpack(w, w_off, k // SUPER, sc[0], sc[1], sc[2], sc[3], sc[4], r)

    return impl


@overload(tile_dots8, inline="always")
def _tile_dots8(code, sc, k, xp, dx, bs, a_in, c0, nc, out):
    qtype = literal_qtype(code)
    if qtype not in _TILE8:
        return None
    tiles = _TILE8[qtype]

    def impl(code, sc, k, xp, dx, bs, a_in, c0, nc, out):
        tiles(sc[0], sc[1], sc[2], sc[3], sc[4], k // SUPER, xp, dx, bs, k // LANES, a_in, c0, nc, out)

    return impl
