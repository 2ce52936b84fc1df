"""One token's attention over its cached positions, the two products as vector loops.

`layer_halves._decode_attention` scores a KV head's cached keys against the query heads that share
it, softmaxes, and sums the values by the weights. Written as numba loops, each score was a dot
product of head_dim numbers ending in a horizontal sum: the sums were as many instructions as the
products. Here:

- `key_scores`: LANES positions at a time and one query head, LANES vector accumulators (one per
  position, over the head's dimensions), reduced into one vector of LANES scores by `qtiles.lane_sums`
  (about three instructions a score instead of eight).
- `weighted_values`: a chunk of LANES value dimensions at a time, for up to eight query heads, each
  cached value chunk loaded once for all of them.

Both read the cache as [KV head, position, dim] rows whose elements lie together (`nn.layers.head_major`),
with any row and head strides. The order of every sum is fixed by the code, not by the call:
cache on and off, one call or another, give the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba.core import cgutils

from . import isa
from .jit import intrinsic, njit, types
from .llvm_ir import F32, I8, I64, VecBuilder, vec
from .qtiles import lane_sums

LANES = 16 if isa.AVX512 else 8  # floats a vector holds (on AVX2 eight: the accumulators fit the 16 registers)
VF = vec(F32, LANES)


def _array(context: Any, b: ir.IRBuilder, aty: Any, val: ir.Value) -> tuple[ir.Value, list[ir.Value], list[ir.Value]]:
    """(i8* data, shape, strides in bytes) of an array argument."""
    a = context.make_array(aty)(context, b, val)
    n = aty.ndim
    shape, strides = cgutils.unpack_tuple(b, a.shape, n), cgutils.unpack_tuple(b, a.strides, n)
    return b.bitcast(a.data, I8.as_pointer()), shape, strides


def _f32_at(b: ir.IRBuilder, base: ir.Value, byte_off: ir.Value) -> ir.Value:
    return b.bitcast(b.gep(base, [byte_off]), F32.as_pointer())


def _i64(x: int) -> ir.Constant:
    return ir.Constant(I64, x)


def _key_scores_typing(typingctx, q, k_cache, kv, h0, per, first, col0, n_blocks, scale, p):
    """For each of n_blocks blocks of LANES cached positions from `first` (cache [KV head, position,
    dim]) and query heads h0..h0+per-1 (q [H, D]): p[j, col0 + block * LANES + i] = scale * q[h0 + j] .
    k_cache[kv, first + block * LANES + i]. D a multiple of LANES. A matrix [row, dim] in place of the
    cache is read as one head's rows (kv unused)."""
    sig = types.void(q, k_cache, types.int64, types.int64, types.int64, types.int64, types.int64, types.int64,
                     types.float32, p)  # fmt: skip

    def codegen(context, b, sig, args):
        v = VecBuilder(b)
        qd, qshape, qst = _array(context, b, sig.args[0], args[0])
        kd, _, kst = _array(context, b, sig.args[1], args[1])
        pd, _, pst = _array(context, b, sig.args[9], args[9])
        kv, h0, per, first, col0, n_blocks, scale = args[2:9]
        n_chunks = b.udiv(qshape[1], _i64(LANES))
        if sig.args[1].ndim == 2:  # a matrix: its rows
            head, kst = kd, [None, kst[0]]
        else:
            head = b.gep(kd, [b.mul(kv, kst[0])])
        scales = v.splat(scale, LANES)
        acc = [cgutils.alloca_once(b, VF) for _ in range(LANES)]  # one per position: [LANES] x [LANES]
        with cgutils.for_range(b, n_blocks) as block:
            pos0 = b.add(first, b.mul(block.index, _i64(LANES)))
            rows = [_f32_at(b, head, b.mul(b.add(pos0, _i64(i)), kst[1])) for i in range(LANES)]
            col = b.mul(b.add(col0, b.mul(block.index, _i64(LANES))), _i64(4))
            with cgutils.for_range(b, per) as j:
                qrow = _f32_at(b, qd, b.mul(b.add(h0, j.index), qst[0]))
                for a in acc:
                    b.store(ir.Constant(VF, None), a)
                with cgutils.for_range(b, n_chunks) as chunk:
                    off = b.mul(chunk.index, _i64(LANES))
                    qv = v.load(qrow, off, F32, LANES, align=4)
                    for i in range(LANES):
                        b.store(v.fma(v.load(rows[i], off, F32, LANES, align=4), qv, b.load(acc[i])), acc[i])
                ((sums, _),) = lane_sums(b, [b.load(a) for a in acc])  # [LANES] scores
                dst = _f32_at(b, pd, b.add(b.mul(j.index, pst[0]), col))
                b.store(b.fmul(sums, scales), b.bitcast(dst, VF.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


_key_scores: Any = intrinsic(_key_scores_typing)


def _values_intrinsic(heads: int) -> Any:
    """weighted_values for `heads` query heads a pass (their weights' rows; the last pass overlapping the
    one before, which writes the same values again). One head a pass takes four positions a step into
    four accumulators: one accumulator was a chain of dependent adds."""
    steps = 4 if heads == 1 else 1

    @intrinsic
    def values(typingctx, p, v_cache, kv, h0, per, first, n, out):
        sig = types.void(p, v_cache, types.int64, types.int64, types.int64, types.int64, types.int64, out)

        def codegen(context, b, sig, args):
            v = VecBuilder(b)
            pd, _, pst = _array(context, b, sig.args[0], args[0])
            vd, vshape, vst = _array(context, b, sig.args[1], args[1])
            od, _, ost = _array(context, b, sig.args[7], args[7])
            kv, h0, per, first, n = args[2:7]
            n_chunks = b.udiv(vshape[2], _i64(LANES))
            rows = b.gep(vd, [b.add(b.mul(kv, vst[0]), b.mul(first, vst[1]))])
            last = b.sub(per, _i64(heads))
            acc = [[cgutils.alloca_once(b, VF) for _ in range(steps)] for _ in range(heads)]
            n_even = b.mul(b.udiv(n, _i64(steps)), _i64(steps))
            with cgutils.for_range(b, b.udiv(b.add(per, _i64(heads - 1)), _i64(heads))) as group:
                j0 = b.mul(group.index, _i64(heads))
                j0 = b.select(b.icmp_signed(">", j0, last), last, j0)
                weights = [_f32_at(b, pd, b.mul(b.add(j0, _i64(t)), pst[0])) for t in range(heads)]
                with cgutils.for_range(b, n_chunks) as chunk:
                    off = b.mul(chunk.index, _i64(LANES))
                    for row in acc:
                        for a in row:
                            b.store(ir.Constant(VF, None), a)

                    def step(s: ir.Value, u: int) -> None:
                        value = v.load(_f32_at(b, rows, b.mul(s, vst[1])), off, F32, LANES, align=4)
                        for t in range(heads):
                            w = v.splat(b.load(b.gep(weights[t], [s])), LANES)
                            b.store(v.fma(w, value, b.load(acc[t][u])), acc[t][u])

                    with cgutils.for_range(b, b.udiv(n, _i64(steps))) as s:
                        for u in range(steps):
                            step(b.add(b.mul(s.index, _i64(steps)), _i64(u)), u)
                    if steps > 1:
                        with cgutils.for_range(b, b.sub(n, n_even)) as s:
                            step(b.add(n_even, s.index), 0)
                    for t in range(heads):
                        total = b.load(acc[t][0])
                        for u in range(1, steps):
                            total = b.fadd(total, b.load(acc[t][u]))
                        dst = _f32_at(b, od, b.mul(b.add(h0, b.add(j0, _i64(t))), ost[0]))
                        b.store(total, b.bitcast(b.gep(dst, [off]), VF.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return values


_VALUES_8, _VALUES_4, _VALUES_1 = (_values_intrinsic(g) for g in (8, 4, 1))


@njit(inline="always")
def fits(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, n: int) -> bool:
    """Whether these shapes take the vector loops: head dims in whole vectors, at least LANES positions,
    each cached row's elements together."""
    return (q.shape[1] % LANES == 0 and v_cache.shape[2] % LANES == 0 and n >= LANES
            and k_cache.strides[2] == 4 and v_cache.strides[2] == 4)  # fmt: skip


@njit(inline="always")
def key_scores(q, k_cache, kv, h0, per, start, n, scale, p):
    """p[j, s] = scale * q[h0 + j] . k_cache[kv, start + s] for j < per, s < n (n >= LANES): whole
    blocks of LANES positions, and a last block that ends at n (overlapping the one before)."""
    _key_scores(q, k_cache, kv, h0, per, start, 0, n // LANES, scale, p)
    if n % LANES:
        _key_scores(q, k_cache, kv, h0, per, start + n - LANES, n - LANES, 1, scale, p)


@njit(inline="always")
def weighted_values(p, v_cache, kv, h0, per, start, n, out):
    """out[h0 + j] = sum over s < n of p[j, s] * v_cache[kv, start + s], for j < per."""
    if per >= 8:
        _VALUES_8(p, v_cache, kv, h0, per, start, n, out)
    elif per >= 4:
        _VALUES_4(p, v_cache, kv, h0, per, start, n, out)
    else:
        _VALUES_1(p, v_cache, kv, h0, per, start, n, out)


@njit(inline="always")
def rows_fit(x: np.ndarray, m: np.ndarray) -> bool:
    """Whether x [T, D] . each row of m [N, D] takes `row_scores`: D in whole vectors, at least LANES
    rows, each row's elements together."""
    return x.shape[1] % LANES == 0 and m.shape[0] >= LANES and x.strides[1] == 4 and m.strides[1] == 4


@njit(inline="always")
def row_scores(x, m, block, out):
    """out[t, r] = x[t] . m[r] for the LANES rows r of block `block` of m [N, D] (the last block ends at
    N, overlapping the one before: it writes the same values again) and every row t of x [T, D]."""
    r0 = min(block * LANES, m.shape[0] - LANES)
    _key_scores(x, m, 0, 0, x.shape[0], r0, r0, 1, np.float32(1), out)
