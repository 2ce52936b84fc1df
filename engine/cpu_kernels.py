"""CPU matmul kernels that read GGUF blocks where they lie (numba), one call per MoE layer per matrix kind.

Every kernel reads a row of a quantized matrix once per call, `GROUP` weights at a time, whatever
the number of tokens that need it: for one token it takes the dot product straight from the
blocks (`qblocks.dot_group`, vector code); for more it decodes the group into a small float32
buffer (`qblocks.decode_group`) and takes the tokens' dot products from there, four at a time.
Both give the same result for a token, bit for bit. Activations and accumulation are float32:
results match the exact path (dequantize, then matmul) to about 1e-6 relative; the tests bound
it at 1e-5.

The MoE kernels take a layer's stacked expert matrices `[S, rows, row_bytes]` (the file's
experts, or a cache's slots holding the same bytes) and a selection in CSR form: for each
selected expert u, the matrix it lives in (`sel[u]`), its expert id (`eid[u]`, for biases), and
its assignments `ptr[u]..ptr[u+1]` (input row `a_in`, output row `a_out`). The work is split over
threads by (expert, tile of rows), so one call covers all the experts of a layer.

- `gate_up`: h = act(x @ gate.T + bg) * (x @ up.T + bu) per assignment, for all selected experts.
- `matmul`: y = scale * (x @ w.T + b) per assignment: the experts' down projection with the
  routing weights (each assignment's contribution kept apart, summed afterwards in expert order
  by `combine`, so where an expert ran never changes the result), and every dense matrix.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from .jit import njit, prange
from .qblocks import GROUP, TOKENS, decode_group, dot_buffer, dot_group

ROWS = 16  # rows per work item: enough items to balance the threads, few enough to amortize them
DIRECT = 1  # up to this many tokens per row, dot products straight from the blocks; more: decode once, then dot

ACT_SILU = 0  # silu(gate) * up
ACT_GELU_TANH = 1  # gelu(gate, tanh approximation) * up (Gemma)
ACT_OAI = 2  # gpt-oss: clamped gate and up, gate * sigmoid(1.702 gate) * (up + 1)
SWIGLU_LIMIT = 7.0
SWIGLU_ALPHA = 1.702


@njit(inline="always")
def _job(job: int, n_tiles: int, n_rows: int, sel: np.ndarray, ptr: np.ndarray) -> tuple[int, int, int, int, int, int]:
    """Work item `job` of (selected matrix, tile of rows): (u, its matrix, first assignment, count, rows r0..r1)."""
    u, tile = job // n_tiles, job % n_tiles
    return u, sel[u], ptr[u], ptr[u + 1] - ptr[u], tile * ROWS, min(n_rows, tile * ROWS + ROWS)


@njit(inline="always")
def _act(kind: int, g: np.float32, u: np.float32) -> np.float32:
    if kind == ACT_SILU:
        return g / (np.float32(1) + np.exp(-g)) * u
    if kind == ACT_GELU_TANH:
        c = np.float32(0.7978845608028654)  # sqrt(2 / pi)
        return np.float32(0.5) * g * (np.float32(1) + np.tanh(c * (g + np.float32(0.044715) * g * g * g))) * u
    g = min(g, np.float32(SWIGLU_LIMIT))
    u = min(max(u, np.float32(-SWIGLU_LIMIT)), np.float32(SWIGLU_LIMIT))
    return (u + np.float32(1)) * (g / (np.float32(1) + np.exp(-np.float32(SWIGLU_ALPHA) * g)))


@njit(inline="always")
def _offsets(x: np.ndarray, a_in: np.ndarray, c0: int, i: int, nc: int, off: int) -> tuple[int, int, int, int]:
    """Byte offsets in x of assignments i..i+3 of a selected matrix (the last repeated past nc)."""
    s = x.strides[0]
    last = c0 + nc - 1
    return (a_in[c0 + i] * s + off, a_in[min(c0 + i + 1, last)] * s + off,
            a_in[min(c0 + i + 2, last)] * s + off, a_in[min(c0 + i + 3, last)] * s + off)  # fmt: skip


@njit(inline="always")
def _add(acc: np.ndarray, i: int, nc: int, sums: tuple[np.float32, np.float32, np.float32, np.float32]) -> None:
    for j in range(min(TOKENS, nc - i)):
        acc[i + j] += sums[j]


@njit(inline="always")
def _row(w: np.ndarray, m: int, r: int) -> int:
    """Byte offset of row r of matrix m in a stack [S, rows, row_bytes]."""
    return m * w.strides[0] + r * w.strides[1]


@functools.cache
def _gate_up_kernel(gate_type: Q, up_type: Q) -> Any:
    # The kernels close over type codes (ints): numba compiles them as constants, and caches each
    # type's kernel on disk apart (a closure over a compiled function would defeat that cache).
    code_g, code_u = int(gate_type), int(up_type)

    @njit(parallel=True, fastmath=False)
    def gate_up(gate, up, x, sel, eid, ptr, a_in, a_out, bias_g, bias_u, act, out):
        n_rows, k = gate.shape[1], x.shape[1]
        n_tiles, n_groups = (n_rows + ROWS - 1) // ROWS, (k + GROUP - 1) // GROUP
        for job in prange(sel.shape[0] * n_tiles):
            u, m, c0, nc, r0, r1 = _job(job, n_tiles, n_rows, sel, ptr)
            yg = np.empty(GROUP, np.float32)
            yu = np.empty(GROUP, np.float32)
            ag = np.empty(nc, np.float32)
            au = np.empty(nc, np.float32)
            for r in range(r0, r1):
                og, ou = _row(gate, m, r), _row(up, m, r)
                if nc <= DIRECT:
                    for i in range(nc):
                        xo = a_in[c0 + i] * x.strides[0]
                        gv = uv = np.float32(0)
                        for g in range(n_groups):
                            gv += dot_group(code_g, gate, og, g, k, x, xo)
                            uv += dot_group(code_u, up, ou, g, k, x, xo)
                        ag[i], au[i] = gv, uv
                else:
                    ag[:] = 0
                    au[:] = 0
                    for g in range(n_groups):
                        n = decode_group(code_g, gate, og, g, k, yg, 0)
                        decode_group(code_u, up, ou, g, k, yu, 0)
                        for i in range(0, nc, TOKENS):
                            xo = _offsets(x, a_in, c0, i, nc, 4 * g * GROUP)
                            _add(ag, i, nc, dot_buffer(yg, n, x, xo))
                            _add(au, i, nc, dot_buffer(yu, n, x, xo))
                for i in range(nc):
                    gv, uv = ag[i], au[i]
                    if bias_g.shape[0]:
                        gv += bias_g[eid[u], r]
                        uv += bias_u[eid[u], r]
                    out[a_out[c0 + i], r] = _act(act, gv, uv)

    return gate_up


@functools.cache
def _matmul_kernel(qtype: Q) -> Any:
    code = int(qtype)

    @njit(parallel=True, fastmath=False)
    def matmul(w, x, sel, eid, ptr, a_in, a_out, bias, scale, out):
        n_rows, k = w.shape[1], x.shape[1]
        n_tiles, n_groups = (n_rows + ROWS - 1) // ROWS, (k + GROUP - 1) // GROUP
        for job in prange(sel.shape[0] * n_tiles):
            u, m, c0, nc, r0, r1 = _job(job, n_tiles, n_rows, sel, ptr)
            y = np.empty(GROUP, np.float32)
            acc = np.empty(nc, np.float32)
            for r in range(r0, r1):
                o = _row(w, m, r)
                if nc <= DIRECT:
                    for i in range(nc):
                        xo = a_in[c0 + i] * x.strides[0]
                        v = np.float32(0)
                        for g in range(n_groups):
                            v += dot_group(code, w, o, g, k, x, xo)
                        acc[i] = v
                else:
                    acc[:] = 0
                    for g in range(n_groups):
                        n = decode_group(code, w, o, g, k, y, 0)
                        for i in range(0, nc, TOKENS):
                            _add(acc, i, nc, dot_buffer(y, n, x, _offsets(x, a_in, c0, i, nc, 4 * g * GROUP)))
                for i in range(nc):
                    v = acc[i]
                    if bias.shape[0]:
                        v += bias[eid[u], r]
                    a = a_out[c0 + i]
                    out[a, r] = v * scale[a] if scale.shape[0] else v

    return matmul


@functools.cache
def _dequantize_kernel(qtype: Q) -> Any:
    code = int(qtype)

    @njit(parallel=True)
    def dequantize(w, k, out):
        n_rows = w.shape[0]
        n_groups = (k + GROUP - 1) // GROUP
        for tile in prange((n_rows + ROWS - 1) // ROWS):
            for r in range(tile * ROWS, min(n_rows, tile * ROWS + ROWS)):
                for g in range(n_groups):
                    decode_group(code, w, r * w.strides[0], g, k, out, r * out.strides[0] + 4 * g * GROUP)

    return dequantize


@njit
def _combine(contrib, ids, out):
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
    x: np.ndarray, sel: np.ndarray, eid: np.ndarray, ptr: np.ndarray, a_in: np.ndarray, a_out: np.ndarray,
    out: np.ndarray, act: int, bias_g: np.ndarray | None = None, bias_u: np.ndarray | None = None,
) -> None:  # fmt: skip
    """out[a_out] = act(x[a_in] @ gate[sel].T + bg, x[a_in] @ up[sel].T + bu) for every selected expert."""
    bg = _NO_BIAS if bias_g is None else bias_g
    bu = _NO_BIAS if bias_u is None else bias_u
    kernel = _gate_up_kernel(gate_type, up_type)
    kernel(_blocks(gate), _blocks(up), _acts(x), sel, eid, ptr, a_in, a_out, bg, bu, act, out)


def matmul(
    w: np.ndarray, qtype: Q, x: np.ndarray, sel: np.ndarray, eid: np.ndarray, ptr: np.ndarray,
    a_in: np.ndarray, a_out: np.ndarray, out: np.ndarray, scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
) -> None:  # fmt: skip
    """out[a_out] = scale[a_out] * (x[a_in] @ w[sel].T + b) for every selected matrix."""
    _matmul_kernel(qtype)(_blocks(w), _acts(x), sel, eid, ptr, a_in, a_out, _NO_BIAS if bias is None else bias,
                          _NO_SCALE if scale is None else scale, out)  # fmt: skip


@functools.cache
def one_matrix(t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The selection arrays of one matrix used by t tokens: (sel = eid, ptr, rows), made once per t."""
    return np.zeros(1, _I64), np.array([0, t], _I64), np.arange(t, dtype=_I64)


def dense(w: np.ndarray, qtype: Q, x: np.ndarray) -> np.ndarray:
    """x [T, K] @ w.T for one quantized matrix w [N, row_bytes] -> [T, N]."""
    t = x.shape[0]
    out = np.empty((t, w.shape[0]), np.float32)
    one, ptr, rows = one_matrix(t)
    _matmul_kernel(qtype)(_blocks(w)[None], _acts(x), one, one, ptr, rows, rows, _NO_BIAS, _NO_SCALE, out)
    return out


def dequantize_rows(w: np.ndarray, qtype: Q, k: int) -> np.ndarray:
    """A quantized matrix [N, row_bytes] -> float32 [N, k], decoded in parallel."""
    out = np.empty((w.shape[0], k), np.float32)
    _dequantize_kernel(qtype)(_blocks(w), k, out)
    return out


def combine(contrib: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Per token, the sum of its k contributions [T*k, D] in ascending expert order -> [T, D]."""
    out = np.empty((ids.shape[0], contrib.shape[1]), np.float32)
    _combine(contrib, ids, out)
    return out
