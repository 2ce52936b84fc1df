"""CPU matmul kernels that read GGUF blocks where they lie (numba), one call per MoE layer per matrix kind.

A kernel first quantizes the activation rows it reads (`qblocks.quantize_rows`, one scale per
256 or per 32) to int16, or to int8 where the caller asks for `bits=8`, then reads each row of a
quantized matrix once for all the tokens that need it, four at a time (`qblocks.dot_row`: integer
products per super-block or per 32 weights, float32 accumulation). Where a matrix of a super-block
type meets four tokens or more (a prompt), its rows are unpacked once and multiplied in tiles of two
rows by four tokens: int16 activations (`qtiles`: the same results as the rows' dot products, so a
token's result never depends on how many tokens share the call), or int8 on a CPU with AVX512-VNNI
(`qtiles8`: the same integers, float sums in another order, within 1e-5 of the largest). Results are
within 1e-4 (int16) or 1e-2 (int8) of the exact product (dequantize, then matmul), relative to the
largest output; the tests hold that.

The MoE kernels take a layer's stacked expert matrices `[S, rows, row_bytes]` (the file's
experts, or a cache's slots holding the same bytes) and a selection in CSR form: for each
selected expert u, the matrix it lives in (`sel[u]`), its expert id (`eid[u]`, for biases), and
its assignments `ptr[u]..ptr[u+1]` (input row `a_in`, output row `a_out`). The work is split over
threads by (expert, tile of rows), so one call covers all the experts of a layer.

- `gate_up`: h = act(x @ gate.T + bg) * (x @ up.T + bu) per assignment, for all selected experts.
- `matmul`: y = scale * (x @ w.T + b) per assignment: the experts' down projection with the
  routing weights (each assignment's contribution kept apart, summed afterwards in expert order
  by `sum_by_token`, so where an expert ran never changes the result), and every dense matrix.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from .codes import ACT_GELU_TANH, ACT_SILU, SWIGLU_ALPHA, SWIGLU_LIMIT
from .jit import njit, overload, prange, types
from .qblocks import SUPER, TOKENS, decode_row, dot_row, quantize_many
from .qtiles import TILE_ROWS, TILE_TOKENS, scratch, tile_dots, tiled, unpack_row
from .qtiles8 import ordered, scratch8, tile_dots8, tiled8, unpack_row8

ROWS = 16  # rows per work item: enough items to balance the threads, few enough to amortize them
TOKEN_BLOCK = 64  # a prompt's tokens per pass over a work item's unpacked rows (int16: 128 bytes per weight)


@njit(inline="always")
def _job(job: int, n_tiles: int, n_rows: int, sel: np.ndarray, ptr: np.ndarray) -> tuple[int, int, int, int, int, int]:
    """Work item `job` of (selected matrix, tile of rows): (u, its matrix, first assignment, count, rows r0..r1)."""
    u, tile = job // n_tiles, job % n_tiles
    return u, sel[u], ptr[u], ptr[u + 1] - ptr[u], tile * ROWS, min(n_rows, tile * ROWS + ROWS)


@njit(inline="always")
def act(kind: int, g: np.float32, u: np.float32) -> np.float32:
    if kind == ACT_SILU:
        return g / (np.float32(1) + np.exp(-g)) * u
    if kind == ACT_GELU_TANH:
        c = np.float32(0.7978845608028654)  # sqrt(2 / pi)
        return np.float32(0.5) * g * (np.float32(1) + np.tanh(c * (g + np.float32(0.044715) * g * g * g))) * u
    g = min(g, np.float32(SWIGLU_LIMIT))
    u = min(max(u, np.float32(-SWIGLU_LIMIT)), np.float32(SWIGLU_LIMIT))
    return (u + np.float32(1)) * (g / (np.float32(1) + np.exp(-np.float32(SWIGLU_ALPHA) * g)))


@njit(inline="always")
def dots(code: int, w: np.ndarray, o: int, k: int, q: Any, a_in: np.ndarray, c0: int, nc: int, acc: np.ndarray) -> None:
    """acc[i] = the row at byte o of w times activation row a_in[c0 + i], i < nc, four tokens a pass."""
    xq, dx, bs = q
    i = 0
    while nc - i >= TOKENS:
        r = (a_in[c0 + i], a_in[c0 + i + 1], a_in[c0 + i + 2], a_in[c0 + i + 3])
        acc[i], acc[i + 1], acc[i + 2], acc[i + 3] = dot_row(code, w, o, k, xq, dx, bs, r)
        i += TOKENS
    for j in range(i, nc):
        acc[j] = dot_row(code, w, o, k, xq, dx, bs, a_in[c0 + j])


@njit(inline="always")
def _row(w: np.ndarray, m: int, r: int) -> int:
    """Byte offset of row r of matrix m in a stack [S, rows, row_bytes]."""
    return m * w.strides[0] + r * w.strides[1]


@njit(inline="always")
def _token_block(j0: int, nc: int) -> tuple[int, int]:
    """The tokens (first, count) of a prompt's block from j0: TOKEN_BLOCK, or the rest; a short last
    block (under TILE_TOKENS) starts earlier, overlapping the one before (the same values again)."""
    count = min(TOKEN_BLOCK, nc - j0)
    return (j0, count) if count >= TILE_TOKENS else (nc - TILE_TOKENS, TILE_TOKENS)


@njit(inline="always")
def _tile_products16(code: int, w: np.ndarray, m: int, r: int, k: int, q: Any, a_in: np.ndarray, c0: int, nc: int,
                     sc: Any, acc: np.ndarray) -> None:  # fmt: skip
    xq, dx, bs = q
    ws, wd, wb = sc
    for i in range(TILE_ROWS):
        unpack_row(code, w, _row(w, m, r + i), k, ws, wd, wb, i)
    tile_dots(code, ws, wd, wb, k, xq, dx, bs, a_in, c0, nc, acc)


@njit(inline="always")
def _tile_products8(code: int, w: np.ndarray, m: int, r: int, k: int, q: Any, xp: np.ndarray, a_in: np.ndarray,
                    c0: int, nc: int, sc: Any, acc: np.ndarray) -> None:  # fmt: skip
    _, dx, bs = q
    for i in range(TILE_ROWS):
        unpack_row8(code, w, _row(w, m, r + i), k, sc, i)
    tile_dots8(code, sc, k, xp, dx, bs, a_in, c0, nc, acc)


def tile_products(code: int, w: np.ndarray, m: int, r: int, k: int, q: Any, xp: np.ndarray, a_in: np.ndarray,
                  c0: int, nc: int, sc: Any, acc: np.ndarray) -> None:  # fmt: skip
    """acc[j, i] = row r + i of matrix m times activation row a_in[c0 + j], i < TILE_ROWS, j < nc
    (>= TILE_TOKENS): the rows unpacked once into the scratch sc, then tiles. A `scratch` gives int16
    tiles, the same results as `dots` (see qtiles); a `scratch8` int8 ones (qtiles8: xp the activations
    `ordered`), within float32 rounding of `dots`' int8 results. Compiled code only."""
    raise NotImplementedError("tile_products runs in compiled code")


@overload(tile_products, inline="always")
def _tile_products(code, w, m, r, k, q, xp, a_in, c0, nc, sc, acc):
    if len(sc) == 5:  # scratch8's (ws, wsc, wcor, wd, wb)

        def impl(code, w, m, r, k, q, xp, a_in, c0, nc, sc, acc):
            _tile_products8(code, w, m, r, k, q, xp, a_in, c0, nc, sc, acc)

    else:

        def impl(code, w, m, r, k, q, xp, a_in, c0, nc, sc, acc):
            _tile_products16(code, w, m, r, k, q, a_in, c0, nc, sc, acc)

    return impl


_NO_ORDER = np.zeros((0, 0), np.uint8)


@njit(inline="always")
def _ordered(q: Any, rows: np.ndarray, k: int, eight: bool) -> np.ndarray:
    """The int8 tiles' activations (qtiles8.ordered) where they run, else an empty array."""
    if eight:
        return ordered(q[0], rows, k)
    return _NO_ORDER


@njit(inline="always")
def _gate_up_out(g: np.ndarray, v: np.ndarray, r0: int, u: int, eid: np.ndarray, a_out: np.ndarray, c0: int,
                 bias_g: np.ndarray, bias_u: np.ndarray, act_code: int, out: np.ndarray) -> None:  # fmt: skip
    """Gate and up products g, v [n, width] of the assignments c0.. and rows r0.. -> out, through the
    activation, with the biases."""
    for i in range(g.shape[0]):
        a = a_out[c0 + i]
        for c in range(g.shape[1]):
            gv, uv = g[i, c], v[i, c]
            if bias_g.shape[0]:
                gv += bias_g[eid[u], r0 + c]
                uv += bias_u[eid[u], r0 + c]
            out[a, r0 + c] = act(act_code, gv, uv)


@njit(inline="always")
def _matmul_out(res: np.ndarray, r0: int, u: int, eid: np.ndarray, a_out: np.ndarray, c0: int, bias: np.ndarray,
                scale: np.ndarray, out: np.ndarray) -> None:  # fmt: skip
    """Products res [n, width] of the assignments c0.. and rows r0.. -> out, with the bias and the
    scale: each assignment's run of rows written in one pass (see `_staged`)."""
    n, width = res.shape
    for i in range(n):
        a = a_out[c0 + i]
        s = scale[a] if scale.shape[0] else np.float32(1)  # times one: the same float
        src, dst = res[i, :width], out[a, r0 : r0 + width]
        if bias.shape[0]:
            b = bias[eid[u], r0 : r0 + width]
            for c in range(width):
                dst[c] = (src[c] + b[c]) * s
        else:
            for c in range(width):
                dst[c] = src[c] * s


def _finish(g: np.ndarray, v: np.ndarray, r0: int, u: int, eid: np.ndarray, a_out: np.ndarray, c0: int,
            bias0: np.ndarray, bias1: np.ndarray, scale: np.ndarray, act_code: int | None,
            out: np.ndarray) -> None:  # fmt: skip
    """A work item's products -> out: gate's and up's through the activation `act_code`, or, where it is
    None, one matrix's (g; v is g) with its bias and scale. Compiled code only."""
    raise NotImplementedError("_finish runs in compiled code")


def _finish_row(g: np.ndarray, v: np.ndarray, nc: int, r: int, u: int, eid: np.ndarray, a_out: np.ndarray, c0: int,
                bias0: np.ndarray, bias1: np.ndarray, scale: np.ndarray, act_code: int | None,
                out: np.ndarray) -> None:  # fmt: skip
    """`_finish` for one row r of nc assignments' products g[:nc] (and v[:nc]), element by element: the same
    floats with no array views. Views cost a built, reference-counted (atomic) array each; made per row,
    they took longer than short rows' products (the output head's 49152 rows of 576: 2.9x the time).
    Compiled code only."""
    raise NotImplementedError("_finish_row runs in compiled code")


@overload(_finish_row, inline="always")
def _finish_row_overload(g, v, nc, r, u, eid, a_out, c0, bias0, bias1, scale, act_code, out):
    one = isinstance(act_code, types.NoneType)

    def impl(g, v, nc, r, u, eid, a_out, c0, bias0, bias1, scale, act_code, out):
        for i in range(nc):
            a = a_out[c0 + i]
            if one:
                y = g[i] + bias0[eid[u], r] if bias0.shape[0] else g[i]
                out[a, r] = y * (scale[a] if scale.shape[0] else np.float32(1))
            else:
                gv, uv = g[i], v[i]
                if bias0.shape[0]:
                    gv += bias0[eid[u], r]
                    uv += bias1[eid[u], r]
                out[a, r] = act(act_code, gv, uv)

    return impl


@overload(_finish, inline="always")
def _finish_overload(g, v, r0, u, eid, a_out, c0, bias0, bias1, scale, act_code, out):
    if isinstance(act_code, types.NoneType):

        def one(g, v, r0, u, eid, a_out, c0, bias0, bias1, scale, act_code, out):
            _matmul_out(g, r0, u, eid, a_out, c0, bias0, scale, out)

        return one

    def pair(g, v, r0, u, eid, a_out, c0, bias0, bias1, scale, act_code, out):
        _gate_up_out(g, v, r0, u, eid, a_out, c0, bias0, bias1, act_code, out)

    return pair


@njit(inline="always")
def _staged(nc: int) -> bool:
    """Whether a work item's results go through a block [tokens, ROWS] first. Its tokens' output rows
    lie a row length apart, and where that is a multiple of 4 KiB (2048 or 4096 floats) writing a
    column of them evicts itself from the core's cache: staged, each token's run of rows is written
    at once. A token or three write directly (no block to allocate: decode)."""
    return nc >= TILE_TOKENS


@functools.cache
def _experts_kernel(qtypes: tuple[Q, ...], bits: int) -> Any:
    """The one kernel of the selected matrices' products (module doc): one matrix (`matmul`: act_code
    None, each output scaled) or two, gate and up (`gate_up`: through the activation `act_code`), both
    read row for row in the same pass."""
    # The kernels close over type codes and flags (ints, bools): numba compiles them as constants, prunes
    # the branches they rule out, and caches each type's kernel on disk apart (a closure over a compiled
    # function would defeat that cache).
    pair = len(qtypes) == 2
    code0, code1 = int(qtypes[0]), int(qtypes[-1])
    # A prompt's experts meet many tokens each: their rows unpacked once, then multiplied in tiles
    # (int16, or int8 where the CPU has VNNI).
    eight = bits == 8 and all(tiled8(t) for t in qtypes)
    tiles = (bits == 16 and all(tiled(t) for t in qtypes)) or eight

    @njit(parallel=True, fastmath=False)
    def experts(w0, w1, x, x_rows, sel, eid, ptr, a_in, a_out, bias0, bias1, scale, act_code, out):
        n_rows, k = w0.shape[1], x.shape[1]
        n_tiles = (n_rows + ROWS - 1) // ROWS
        q = quantize_many(x, x_rows, bits)
        xp = _ordered(q, x_rows, k, eight and k % SUPER == 0)
        for job in prange(sel.shape[0] * n_tiles):
            u, m, c0, nc, r0, r1 = _job(job, n_tiles, n_rows, sel, ptr)
            if not _staged(nc):
                a0 = np.empty(nc, np.float32)
                a1 = np.empty(nc, np.float32) if pair else a0
                for r in range(r0, r1):
                    dots(code0, w0, _row(w0, m, r), k, q, a_in, c0, nc, a0)
                    if pair:
                        dots(code1, w1, _row(w1, m, r), k, q, a_in, c0, nc, a1)
                    _finish_row(a0, a1, nc, r, u, eid, a_out, c0, bias0, bias1, scale, act_code, out)
                continue
            # A block of tokens at a time: their activations stay in the core's cache while every
            # row of the work item meets them.
            tb = min(nc, TOKEN_BLOCK)
            res0 = np.empty((tb, ROWS), np.float32)  # [tokens, rows]
            res1 = np.empty((tb, ROWS), np.float32) if pair else res0
            done = r0  # rows done in tiles
            if tiles:  # noqa: SIM102 - the flag is a constant numba prunes by, the width is not
                if k % SUPER == 0:
                    if eight:
                        s0 = scratch8(k)
                        s1 = scratch8(k) if pair else s0
                    else:
                        s0 = scratch(k)
                        s1 = scratch(k) if pair else s0
                    n_tiled = (r1 - r0) // TILE_ROWS * TILE_ROWS
                    for j0 in range(0, nc, TOKEN_BLOCK):
                        j, n = _token_block(j0, nc)
                        for r in range(r0, r0 + n_tiled, TILE_ROWS):
                            c = r - r0
                            tile_products(code0, w0, m, r, k, q, xp, a_in, c0 + j, n, s0, res0[:n, c : c + TILE_ROWS])
                            if pair:
                                tile_products(
                                    code1, w1, m, r, k, q, xp, a_in, c0 + j, n, s1, res1[:n, c : c + TILE_ROWS]
                                )
                        _finish(res0[:n, :n_tiled], res1[:n, :n_tiled], r0, u, eid, a_out, c0 + j, bias0, bias1,
                                scale, act_code, out)  # fmt: skip
                    done += n_tiled
            if done < r1:
                a0 = np.empty(tb, np.float32)
                for j in range(0, nc, TOKEN_BLOCK):
                    n = min(TOKEN_BLOCK, nc - j)
                    for r in range(done, r1):
                        dots(code0, w0, _row(w0, m, r), k, q, a_in, c0 + j, n, a0)
                        res0[:n, r - done] = a0[:n]
                        if pair:
                            dots(code1, w1, _row(w1, m, r), k, q, a_in, c0 + j, n, a0)
                            res1[:n, r - done] = a0[:n]
                    _finish(res0[:n, : r1 - done], res1[:n, : r1 - done], done, u, eid, a_out, c0 + j, bias0,
                            bias1, scale, act_code, out)  # fmt: skip

    return experts


@functools.cache
def _dense_many_kernel(qtype: Q, bits: int) -> Any:
    code = int(qtype)

    @njit(parallel=True, fastmath=False)
    def dense_many(ws, x, rows, first_tile, outs):
        """outs[m] = x @ ws[m].T for every matrix m of the tuple ws: one parallel region, x quantized once."""
        k = x.shape[1]
        q = quantize_many(x, rows, bits)
        nc = rows.shape[0]
        for job in prange(first_tile[-1]):
            m = np.searchsorted(first_tile, job, side="right") - 1
            w, out = ws[m], outs[m]
            r0 = (job - first_tile[m]) * ROWS
            acc = np.empty(nc, np.float32)
            for r in range(r0, min(w.shape[0], r0 + ROWS)):
                dots(code, w, r * w.strides[0], k, q, rows, 0, nc, acc)
                for i in range(nc):
                    out[i, r] = acc[i]

    return dense_many


@functools.cache
def _dequantize_kernel(qtype: Q) -> Any:
    code = int(qtype)

    @njit(parallel=True)
    def dequantize(w, k, out):
        n_rows = w.shape[0]
        for tile in prange((n_rows + ROWS - 1) // ROWS):
            for r in range(tile * ROWS, min(n_rows, tile * ROWS + ROWS)):
                decode_row(code, w, r * w.strides[0], k, out, r * out.strides[0])

    return dequantize


@njit
def _selection(ids, chosen):
    """The selection in CSR form (see the module's doc) of the pairs of ids [T, k] whose expert is in
    `chosen` (empty: all): assignments a grouped by ascending expert (stable), the experts, ptr,
    each assignment's token, and the tokens named, ascending."""
    t_n, k = ids.shape
    flat = ids.reshape(-1)
    n_expert = flat.max() + 1 if flat.size else 0
    wanted = np.ones(n_expert, np.bool_)
    if chosen.size:
        wanted[:] = False
        for e in chosen:
            if e < n_expert:
                wanted[e] = True
    counts = np.zeros(n_expert + 1, np.int64)
    for e in flat:
        if wanted[e]:
            counts[e + 1] += 1
    eids = np.flatnonzero(counts[1:])
    starts = np.cumsum(counts)  # [n_expert + 1]: where each expert's assignments begin
    a = np.empty(starts[-1], np.int64)
    fill = starts[:-1].copy()
    token_named = np.zeros(t_n, np.bool_)
    for i in range(flat.size):
        e = flat[i]
        if wanted[e]:
            a[fill[e]] = i
            fill[e] += 1
            token_named[i // k] = True
    ptr = np.empty(eids.size + 1, np.int64)
    for u in range(eids.size):
        ptr[u] = starts[eids[u]]
    ptr[eids.size] = a.size
    return a, eids, ptr, a // k, np.flatnonzero(token_named)


@njit
def _sum_by_token(contrib, ids, out):
    t_n, k = ids.shape
    for t in range(t_n):
        order = np.argsort(ids[t], kind="mergesort")
        out[t, :] = 0
        for j in order:
            out[t, :] += contrib[t * k + j]


# -- Python side ---------------------------------------------------------------------------------

_NO_BIAS = np.zeros((0, 0), np.float32)
_NO_SCALE = np.zeros(0, np.float32)
_I64 = np.int64


def _blocks(w: np.ndarray) -> np.ndarray:
    """The kernels read a row's bytes from a pointer: each row must be contiguous (a view of the file's map is)."""
    if w.dtype != np.uint8 or w.strides[-1] != 1:
        raise ValueError(f"quantized rows must be contiguous uint8, got {w.dtype} with strides {w.strides}")
    return w


def _acts(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def gate_up(
    gate: np.ndarray, gate_type: Q, up: np.ndarray, up_type: Q,
    x: np.ndarray, x_rows: np.ndarray, sel: np.ndarray, eid: np.ndarray, ptr: np.ndarray, a_in: np.ndarray,
    a_out: np.ndarray, out: np.ndarray, act: int, bias_g: np.ndarray | None = None, bias_u: np.ndarray | None = None,
    bits: int = 16,
) -> None:  # fmt: skip
    """out[a_out] = act(x[a_in] @ gate[sel].T + bg, x[a_in] @ up[sel].T + bu) for every selected expert.

    x_rows: the rows of x that a_in names, each once (the kernel quantizes them before the products,
    to `bits`: 8 or 16).
    """
    bg = _NO_BIAS if bias_g is None else bias_g
    bu = _NO_BIAS if bias_u is None else bias_u
    kernel = _experts_kernel((gate_type, up_type), bits)
    kernel(_blocks(gate), _blocks(up), _acts(x), x_rows, sel, eid, ptr, a_in, a_out, bg, bu, _NO_SCALE, act, out)


def matmul(
    w: np.ndarray, qtype: Q, x: np.ndarray, x_rows: np.ndarray, sel: np.ndarray, eid: np.ndarray, ptr: np.ndarray,
    a_in: np.ndarray, a_out: np.ndarray, out: np.ndarray, scale: np.ndarray | None = None,
    bias: np.ndarray | None = None, bits: int = 16,
) -> None:  # fmt: skip
    """out[a_out] = scale[a_out] * (x[a_in] @ w[sel].T + b) for every selected matrix (x_rows as for gate_up)."""
    b, s = _NO_BIAS if bias is None else bias, _NO_SCALE if scale is None else scale
    w = _blocks(w)
    _experts_kernel((qtype,), bits)(w, w, _acts(x), x_rows, sel, eid, ptr, a_in, a_out, b, _NO_BIAS, s, None, out)


def tiles_read(qtype: Q, k: int, bits: int) -> bool:
    """Whether a prompt's products with rows of this type and width, activations of `bits`, run in
    the integer tiles (the kernels' own condition: a super-block type, whole super-blocks, int16 or,
    on a CPU with AVX512-VNNI, int8)."""
    return ((bits == 16 and tiled(qtype)) or (bits == 8 and tiled8(qtype))) and k % SUPER == 0


@functools.cache
def one_matrix(t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The selection arrays of one matrix used by t tokens: (sel = eid, ptr, rows), made once per t."""
    return np.zeros(1, _I64), np.array([0, t], _I64), np.arange(t, dtype=_I64)


def dense(w: np.ndarray, qtype: Q, x: np.ndarray, bits: int = 16) -> np.ndarray:
    """x [T, K] @ w.T for one quantized matrix w [N, row_bytes] -> [T, N]."""
    t = x.shape[0]
    out = np.empty((t, w.shape[0]), np.float32)
    one, ptr, rows = one_matrix(t)
    matmul(w[None], qtype, x, rows, one, one, ptr, rows, rows, out, bits=bits)
    return out


def dense_many(ws: tuple[np.ndarray, ...], qtype: Q, x: np.ndarray, bits: int = 16) -> tuple[np.ndarray, ...]:
    """x [T, K] @ w.T for several matrices of one type and width (a layer's q, k and v) in one call."""
    t = x.shape[0]
    outs = tuple(np.empty((t, w.shape[0]), np.float32) for w in ws)
    first_tile = np.zeros(len(ws) + 1, _I64)
    np.cumsum([(w.shape[0] + ROWS - 1) // ROWS for w in ws], out=first_tile[1:])
    _dense_many_kernel(qtype, bits)(tuple(_blocks(w) for w in ws), _acts(x), one_matrix(t)[2], first_tile, outs)
    return outs


def dequantize_rows(w: np.ndarray, qtype: Q, k: int) -> np.ndarray:
    """A quantized matrix [N, row_bytes] -> float32 [N, k], decoded in parallel."""
    out = np.empty((w.shape[0], k), np.float32)
    _dequantize_kernel(qtype)(_blocks(w), k, out)
    return out


def selection(ids: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, ...]:
    """(a, eids, ptr, a_in, x_rows) for gate_up: the pairs of ids [T, k] (int64) whose expert is in
    `chosen` (empty: all)."""
    return _selection(ids, chosen)


def sum_by_token(contrib: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per token, the sum of its k contributions [T*k, D] in ascending expert order -> [T, D]."""
    out = np.empty((ids.shape[0], contrib.shape[1]), np.float32)
    _sum_by_token(contrib, ids, out)
    return out
