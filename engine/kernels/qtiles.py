"""A super-block type's rows unpacked once, then multiplied with many tokens: the tiles of a prompt.

`dot_row` unpacks a row's integers for every four tokens it multiplies. When a matrix meets many
tokens at once (a prompt's experts: tens of tokens each), that unpacking is most of the work. Here
a few rows are unpacked once into a small scratch (`unpack_row`: each weight's integer times its
integer sub-scale, as int16, with the block's d and bias), and `tile_dots` multiplies TILE_ROWS of
them with TILE_TOKENS tokens at a time, each activation chunk loaded once for all the rows and each
weight chunk once for all the tokens (int16 activations, one scale per 256; pmaddwd, fused into
vpdpwssd with VNNI).

Every (row, token) result comes from the same operations, in the same order, as `dot_row`'s
(`qblocks._int_block`, then the same sums): bit-identical, so whether a token's products ran here
or there never changes it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as Q
from llvmlite import ir
from numba.core import cgutils

from .jit import intrinsic, overload, types
from .llvm_ir import (
    F32,
    I8,
    I16,
    I32,
    I64,
    LANES,
    V8_F32,
    V_I16,
    V_I32,
    VecBuilder,
    byte_ptr,
    hsum,
    literal_qtype,
    pair_sums,
    row_ptr,
    vec,
)
from .qblocks import LAYOUTS, SUPER, Layout

TILE_ROWS = 2  # rows per tile: each activation chunk loaded once for them
TILE_TOKENS = 4  # tokens per tile: each weight chunk loaded once for them
CHUNKS = SUPER // LANES
V16_F32 = vec(F32, 16)


def tiled(qtype: Q) -> bool:
    """Whether rows of this type unpack to integers with integer scales (the super-blocks)."""
    return qtype in LAYOUTS and LAYOUTS[qtype].ints is not None


@functools.cache
def has_bias(qtype: Q) -> bool:
    """Whether the type's integer form has a per-chunk bias (the mins): asked of the layout itself."""
    ints = LAYOUTS[qtype].ints
    assert ints is not None  # callers check tiled()
    fn = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), [I8.as_pointer()]), "probe")
    return ints(VecBuilder(ir.IRBuilder(fn.append_basic_block())), fn.args[0]).bias is not None


def hsums(b: ir.IRBuilder, vs: list[ir.Value]) -> list[ir.Value]:
    """Each vector's `llvm_ir.hsum`, bit for bit (the same lanes added in the same tree), with the
    vectors reduced side by side: two half-reduced vectors share one add, so n sums of 16 lanes take
    about 3n instructions instead of 8n."""
    return [b.extract_element(v, ir.Constant(I32, j)) for v, m in lane_sums(b, vs) for j in range(m)]


def lane_sums(b: ir.IRBuilder, vs: list[ir.Value]) -> list[tuple[ir.Value, int]]:
    """`hsums` left in vectors: (vector, m) pairs whose lanes are the sums of m of vs each, in vs' order
    (n vectors of n lanes, n a power of two: one vector holding all n sums)."""
    width = vs[0].type.count
    phys = [(v, 1) for v in vs]  # (vector, how many equal parts it holds, each of `width` lanes)
    while width > 1:
        half, merged = width // 2, []
        i = 0
        while i < len(phys):
            x, m = phys[i]
            pair = i + 1 < len(phys) and phys[i + 1][1] == m
            y = phys[i + 1][0] if pair else x
            n = 2 if pair else 1
            lo = [s * m * width + j * width + lane for s in range(n) for j in range(m) for lane in range(half)]
            hi = [i_ + half for i_ in lo]
            mask = ir.Constant(vec(I32, len(lo)), lo), ir.Constant(vec(I32, len(hi)), hi)
            merged.append((b.fadd(b.shuffle_vector(x, y, mask[0]), b.shuffle_vector(x, y, mask[1])), n * m))
            i += n
        phys, width = merged, half
    return phys


def _unpack_intrinsic(layout: Layout) -> Any:
    ints = layout.ints
    assert ints is not None

    @intrinsic
    def unpack(typingctx, w, w_off, n_blocks, ws, wd, wb, r):
        """n_blocks super-blocks at byte w_off of w -> row r of ws (int16 weight times sub-scale), wd
        (each block's d) and wb (each chunk's bias; left alone for types without one)."""
        sig = types.void(w, types.int64, types.int64, ws, wd, wb, types.int64)

        def codegen(context, builder, sig, args):
            v, b = VecBuilder(builder), builder
            wp = byte_ptr(context, b, sig.args[0], args[0], args[1])
            wsp, wdp, wbp = (row_ptr(context, b, sig.args[i], args[i], args[6], t) for i, t in ((3, I16), (4, F32),
                                                                                              (5, F32)))  # fmt: skip
            with cgutils.for_range(b, args[2]) as loop:
                i = loop.index
                block = ints(v, v.at(wp, b.mul(i, ir.Constant(I64, layout.size))))
                first = b.mul(i, ir.Constant(I64, SUPER))
                for c, chunk in enumerate(block.chunks):
                    q = b.sext(chunk.q, V_I16) if chunk.signed else b.zext(chunk.q, V_I16)
                    dst = b.bitcast(v.at(wsp, b.add(first, ir.Constant(I64, c * LANES))), V_I16.as_pointer())
                    b.store(b.mul(q, chunk.scale), dst, align=2)
                b.store(block.d, v.at(wdp, i), align=4)
                if block.bias is not None:
                    dst = b.bitcast(v.at(wbp, b.mul(i, ir.Constant(I64, CHUNKS))), V8_F32.as_pointer())
                    b.store(block.bias, dst, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return unpack


Pair = tuple[int, int]  # (row of the tile, token of the group)
PAIRS: list[Pair] = [(r, t) for r in range(TILE_ROWS) for t in range(TILE_TOKENS)]


class Group(NamedTuple):
    """What a tile intrinsic does for one group of TILE_TOKENS tokens (see `tile_loop`)."""

    products: Callable[[dict[Pair, ir.Value]], None]  # adds each pair's products into its 16-lane accumulator
    bias_sums: list[ir.Value]  # per token: its activations' per-chunk sums (float32), for the mins


def tile_loop(
    context: Any, b: ir.IRBuilder, sig: Any, args: Any, *, a_in: int, c0: ir.Value, nc: ir.Value, out: int,
    n_blocks: ir.Value, bias_rows: list[ir.Value] | None, group: Callable[[list[ir.Value]], Group],
    dot_row_sums: bool,
) -> None:  # fmt: skip
    """The loop every tile intrinsic shares: activation rows a_in[c0 + j], j < nc (>= TILE_TOKENS),
    TILE_TOKENS at a time, the last group overlapping the one before (the same values again). For each
    group, `group(tokens)` says how its products are made; the rows' biases (`bias_rows`, per chunk,
    where the type has mins) times the tokens' sums go into accumulators of their own, in a loop of
    their own (fewer accumulators live in the products' loop); then each (row, token)'s float sum goes
    to out[j + token, row]. `dot_row_sums`: summed as dot_row sums (bit for bit the int16 dots),
    else products plus biases."""
    v = VecBuilder(b)
    i64 = functools.partial(ir.Constant, I64)
    n_t = TILE_TOKENS
    a_p = b.bitcast(byte_ptr(context, b, sig.args[a_in], args[a_in], i64(0)), I64.as_pointer())
    acc = {p: cgutils.alloca_once(b, V16_F32) for p in PAIRS}
    accb = {p: cgutils.alloca_once(b, V8_F32) for p in PAIRS}
    last = b.sub(nc, i64(n_t))
    with cgutils.for_range(b, b.udiv(b.add(nc, i64(n_t - 1)), i64(n_t))) as loop:
        j = b.mul(loop.index, i64(n_t))
        j = b.select(b.icmp_signed(">", j, last), last, j)
        tokens = [b.load(v.at(a_p, b.add(c0, b.add(j, i64(t))))) for t in range(n_t)]
        g = group(tokens)
        for p in PAIRS:
            b.store(ir.Constant(V16_F32, None), acc[p])
            b.store(ir.Constant(V8_F32, None), accb[p])
        g.products(acc)
        if bias_rows is not None:
            with cgutils.for_range(b, n_blocks) as blocks:
                chunk0 = b.mul(blocks.index, i64(CHUNKS))
                for r, t in PAIRS:
                    wbias = v.load(bias_rows[r], chunk0, F32, 8, align=4)
                    bsum = v.load(g.bias_sums[t], chunk0, F32, 8, align=4)
                    b.store(v.fma(wbias, bsum, b.load(accb[r, t])), accb[r, t])
        if dot_row_sums:  # dot_row's final sums, lane for lane: its unused 8-lane accumulators, products, biases
            zero8, zero16 = ir.Constant(V8_F32, None), ir.Constant(V16_F32, None)
            unused = hsum(b, b.fadd(zero8, zero8))
            products = hsums(b, [b.fadd(b.load(acc[p]), zero16) for p in PAIRS])
        else:
            products = hsums(b, [b.load(acc[p]) for p in PAIRS])
        biases = hsums(b, [b.load(accb[p]) for p in PAIRS])
        outp = [row_ptr(context, b, sig.args[out], args[out], b.add(j, i64(t)), F32) for t in range(n_t)]
        for (r, t), s, sb in zip(PAIRS, products, biases, strict=True):
            total = b.fadd(b.fadd(unused, s), sb) if dot_row_sums else b.fadd(s, sb)
            b.store(total, v.at(outp[t], i64(r)), align=4)


def _tile_intrinsic(qtype: Q) -> Any:
    n_r, bias = TILE_ROWS, has_bias(qtype)

    @intrinsic
    def tiles(typingctx, ws, wd, wb, n_blocks, xq, dx, bs, a_in, c0, nc, out):
        """The scratch's TILE_ROWS rows times activation rows a_in[c0 + j], j < nc (>= TILE_TOKENS),
        of quantize_rows' int16 (xq, dx, bs) -> out[j, row] (rows of out may lie apart, its
        elements not): TILE_TOKENS tokens at a time (`tile_loop`)."""
        sig = types.void(ws, wd, wb, types.int64, xq, dx, bs, a_in, types.int64, types.int64, out)

        def codegen(context, builder, sig, args):
            v, b = VecBuilder(builder), builder
            i64 = functools.partial(ir.Constant, I64)
            n_blocks = args[3]
            wsp, wdp, wbp = ([row_ptr(context, b, sig.args[i], args[i], i64(r), t) for r in range(n_r)]
                             for i, t in ((0, I16), (1, F32), (2, F32)))  # fmt: skip

            def group(tokens: list[ir.Value]) -> Group:
                xps, dps, bps = ([row_ptr(context, b, sig.args[i], args[i], tok, t) for tok in tokens]
                                 for i, t in ((4, I16), (5, F32), (6, F32)))  # fmt: skip

                def products(acc: dict[Pair, ir.Value]) -> None:  # dot_row's super-block accumulators per pair
                    with cgutils.for_range(b, n_blocks) as loop:
                        first = b.mul(loop.index, i64(SUPER))
                        chunk0 = b.mul(loop.index, i64(CHUNKS))
                        sums: dict[Pair, ir.Value] = {}
                        for c in range(CHUNKS):
                            off = b.add(first, i64(c * LANES))
                            wv = [b.sext(v.load(p, off, I16, align=2), V_I32) for p in wsp]
                            xv = [b.sext(v.load(p, off, I16, align=2), V_I32) for p in xps]
                            for r, t in PAIRS:  # integers: any order of adds gives dot_row's sum
                                term = pair_sums(b, b.mul(wv[r], xv[t]))  # <16 x i32>
                                sums[r, t] = b.add(sums[r, t], term) if c else term
                        for r, t in PAIRS:
                            d = b.load(v.at(wdp[r], loop.index), align=4)
                            scale = v.splat(b.fmul(d, b.load(v.at(dps[t], chunk0), align=4)), 16)
                            b.store(v.fma(b.sitofp(sums[r, t], V16_F32), scale, b.load(acc[r, t])), acc[r, t])

                return Group(products, bps)

            tile_loop(context, b, sig, args, a_in=7, c0=args[8], nc=args[9], out=10, n_blocks=n_blocks,
                      bias_rows=wbp if bias else None, group=group, dot_row_sums=True)  # fmt: skip
            return context.get_dummy_value()

        return sig, codegen

    return tiles


_UNPACK = {t: _unpack_intrinsic(lay) for t, lay in LAYOUTS.items() if lay.ints is not None}
_TILE = {t: _tile_intrinsic(t) for t in _UNPACK}


def scratch(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Room for TILE_ROWS unpacked rows of k weights: (ws [TILE_ROWS, k] int16, their blocks' d,
    their chunks' biases)."""
    raise NotImplementedError("scratch runs in compiled code")


def unpack_row(code: int, w: np.ndarray, w_off: int, k: int, ws: np.ndarray, wd: np.ndarray, wb: np.ndarray,
               r: int) -> None:  # fmt: skip
    """The row of k weights at byte w_off of w into row r of a scratch (ws, wd, wb). Compiled code
    only; `code` a compile-time constant of a type `tiled` accepts."""
    raise NotImplementedError("unpack_row runs in compiled code")


def tile_dots(code: int, ws: np.ndarray, wd: np.ndarray, wb: np.ndarray, k: int, xq: np.ndarray, dx: np.ndarray,
              bs: np.ndarray, a_in: np.ndarray, c0: int, nc: int, out: np.ndarray) -> None:  # fmt: skip
    """The scratch's TILE_ROWS rows times activation rows a_in[c0 + j], j < nc (at least
    TILE_TOKENS), of quantize_rows' int16 output -> out[j, row] (float32; out's rows may lie apart,
    as a column slice of a wider block does). Compiled code only."""
    raise NotImplementedError("tile_dots runs in compiled code")


@overload(scratch, inline="always")
def _scratch(k):
    def impl(k):
        n_blocks = k // SUPER
        zeros = np.zeros((TILE_ROWS, n_blocks * CHUNKS), np.float32)  # types without biases add these zeros
        return np.empty((TILE_ROWS, k), np.int16), np.empty((TILE_ROWS, n_blocks), np.float32), zeros

    return impl


@overload(unpack_row, inline="always")
def _unpack_row(code, w, w_off, k, ws, wd, wb, r):
    qtype = literal_qtype(code)
    if qtype not in _UNPACK:
        return None
    unpack = _UNPACK[qtype]

    def impl(code, w, w_off, k, ws, wd, wb, r):
        unpack(w, w_off, k // SUPER, ws, wd, wb, r)

    return impl


@overload(tile_dots, inline="always")
def _tile_dots(code, ws, wd, wb, k, xq, dx, bs, a_in, c0, nc, out):
    qtype = literal_qtype(code)
    if qtype not in _TILE:
        return None
    tiles = _TILE[qtype]

    def impl(code, ws, wd, wb, k, xq, dx, bs, a_in, c0, nc, out):
        tiles(ws, wd, wb, k // SUPER, xq, dx, bs, a_in, c0, nc, out)

    return impl
