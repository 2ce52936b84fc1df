"""Device kernels (Triton) for a MoE layer's selected experts, reading the GGUF blocks where they lie.

The expert cache's slots hold the file's bytes (an upload is a plain copy). Per MoE layer and
batch, three launches cover every selected expert that runs on the device, whatever k is:

- `_gate_up_kernel`, grid (pairs, row tiles of F): gate and up of pair p's expert, read from its
  slot through the pair table, with the activation (and the experts' biases) fused -> h [P, F];
- `_down_kernel`, grid (pairs, row tiles of E): down times h, plus bias, times the routing weight,
  into the pair's row t*k + j of the contributions [T*k, E];
- `_combine_kernel`, grid (tokens, row tiles of E): each token's k rows summed in ascending expert
  order, taking each row from the device's contributions or from the copy of the CPU share's,
  as the CPU path sums them (fused_moe).

Weights are decoded in registers from the block bytes, a tile of rows by 256 columns at a time,
and accumulated in float32: each type's decoding follows gguf-py's dequantizer (tests: relative
error <= 1e-5 against it; fused multiply-adds make it differ in the last bits).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set
here before triton is imported when torch sees no GPU): slow, but the same code, so the tests
check the numerics and count the launches on any machine with triton installed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..gguf.codebooks import IQ4_NL_VALUES, MXFP4_VALUES
from ..gguf.quant_types import DEVICE, types_for
from .codes import GEMM_TOKENS

logger = logging.getLogger(__name__)

Q = GGMLQuantizationType
TYPES: frozenset[GGMLQuantizationType] = types_for(DEVICE)  # each has a branch in `_weights`
BLOCK_R = 16  # rows of a weight tile on a GPU
INTERPRET_R = 64  # in the interpreter a program is a Python call: fewer, larger tiles
COLS = 256  # columns of a weight tile: one super-block, or eight 32-weight blocks

# The non-linear 4-bit code books, in one table: IQ4_NL's values, then MXFP4's (doubled e2m1).
_CODE_BOOK = IQ4_NL_VALUES + MXFP4_VALUES


def available() -> bool:
    """Whether triton is installed (it ships with torch's CUDA wheels on Linux; the test extra adds it)."""
    return importlib.util.find_spec("triton") is not None


def supports(qtypes: tuple[GGMLQuantizationType, ...]) -> bool:
    return available() and all(t in TYPES for t in qtypes)


if available():
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels below are decorated
    import triton
    import triton.language as tl

    @triton.jit
    def _f16(p: Any, m: Any) -> Any:
        """The float16 at byte pointers p (little-endian), as float32."""
        lo = tl.load(p, mask=m, other=0).to(tl.uint16)
        hi = tl.load(p + 1, mask=m, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _byte(p: Any, m: Any) -> Any:
        return tl.load(p, mask=m, other=0).to(tl.int32)

    @triton.jit
    def _k_scale_min(blk: Any, s: Any, m: Any) -> tuple[Any, Any]:
        """Q4_K/Q5_K: the 6-bit scale and min of sub-block s (0..7), from the 12 bytes at 4."""
        a = _byte(blk + 4 + s, m)  # q[s]
        b = _byte(blk + 8 + s, m)  # q[s + 4]
        c = _byte(blk + 4 + s % 4, m)  # q[s - 4] for s >= 4
        sc = tl.where(s < 4, a & 63, (b & 0xF) | ((c >> 6) << 4))
        mn = tl.where(s < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _weights(blk: Any, i: Any, m: Any, book: Any, QT: tl.constexpr) -> Any:
        """Weights i of the blocks at byte pointers blk (both [R, C]), decoded as gguf-py does."""
        if QT == 8:  # Q8_0: d, 32 int8
            q = tl.load(blk + 2 + i, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            return q * _f16(blk, m)
        elif QT == 2:  # Q4_0: d, 16 bytes (low nibbles: weights 0-15, high: 16-31), code - 8
            q = ((_byte(blk + 2 + i % 16, m) >> ((i // 16) * 4)) & 0xF) - 8
            return q.to(tl.float32) * _f16(blk, m)
        elif QT == 39:  # MXFP4: E8M0 exponent, 16 bytes of e2m1 codes (doubled values, half the scale)
            e = _byte(blk, m)
            d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
            code = (_byte(blk + 1 + i % 16, m) >> ((i // 16) * 4)) & 0xF
            return d * tl.load(book + 16 + code, mask=m, other=0.0)
        elif QT == 12 or QT == 13:  # Q4_K, Q5_K: d, dmin, 12 bytes of scales/mins, [Q5_K: 32 high bits], nibbles
            s = i // 32  # sub-block
            sc, mn = _k_scale_min(blk, s, m)
            d1 = _f16(blk, m) * sc
            m1 = _f16(blk + 2, m) * mn
            start = 16 if QT == 12 else 48
            q = (_byte(blk + start + (i // 64) * 32 + i % 32, m) >> ((s % 2) * 4)) & 0xF
            if QT == 13:
                q = q | (((_byte(blk + 16 + i % 32, m) >> s) & 1) << 4)
            return d1 * q.to(tl.float32) - m1
        elif QT == 14:  # Q6_K: 128 bytes low nibbles, 64 bytes high pairs, 16 int8 scales, d
            half = i // 128
            quarter = (i % 128) // 32
            lane = i % 32
            lo = (_byte(blk + half * 64 + (quarter % 2) * 32 + lane, m) >> ((quarter // 2) * 4)) & 0xF
            hi = (_byte(blk + 128 + half * 32 + lane, m) >> (2 * quarter)) & 3
            sc = tl.load(blk + 192 + half * 8 + quarter * 2 + lane // 16, mask=m, other=0).to(tl.int8, bitcast=True)
            dl = _f16(blk + 208, m) * sc.to(tl.float32)
            return dl * ((lo | (hi << 4)) - 32).to(tl.float32)
        else:  # IQ4_XS (23): d, 16 high scale bits, 4 bytes of low scale nibbles, 8 x 16 bytes of codes
            sb = i // 32
            scales_h = _byte(blk + 2, m) | (_byte(blk + 3, m) << 8)
            low = (_byte(blk + 4 + sb // 2, m) >> ((sb % 2) * 4)) & 0xF
            ls = low | (((scales_h >> (2 * sb)) & 3) << 4)
            dl = _f16(blk, m) * (ls - 32).to(tl.float32)
            code = (_byte(blk + 8 + sb * 16 + i % 16, m) >> (((i % 32) // 16) * 4)) & 0xF
            return dl * tl.load(book + code, mask=m, other=0.0)

    @triton.jit
    def _row_dots(
        w: Any, row_bytes: Any, rows: Any, rmask: Any, x: Any, K: Any, book: Any,
        QT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, C: tl.constexpr,
    ) -> Any:  # fmt: skip
        """[R] float32: the rows `rows` of the matrix at w (rows of row_bytes) times x [K]."""
        acc = tl.zeros([rows.shape[0]], dtype=tl.float32)
        j = tl.arange(0, C)[None, :]  # [1, C]
        base = w + rows[:, None].to(tl.int64) * row_bytes  # [R, 1]
        for c in range(0, tl.cdiv(K, C)):
            col = c * C + j
            cm = col < K
            m = rmask[:, None] & cm  # [R, C]
            wt = _weights(base + (col // QK) * TS, col % QK, m, book, QT)  # [R, C]
            xv = tl.load(x + col, mask=cm, other=0.0)  # [1, C]
            acc += tl.sum(wt * xv, axis=1)
        return acc

    @triton.jit
    def _act(g: Any, u: Any, ACT: tl.constexpr) -> Any:
        if ACT == 0:  # silu(gate) * up
            return g / (1.0 + tl.exp(-g)) * u
        elif ACT == 1:  # gelu(gate, tanh approximation) * up
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)) * u
        else:  # gpt-oss: clamped gate and up
            g = tl.minimum(g, 7.0)
            u = tl.minimum(tl.maximum(u, -7.0), 7.0)
            return (u + 1.0) * (g / (1.0 + tl.exp(-1.702 * g)))

    @triton.jit
    def _gate_up_kernel(
        x: Any, gate: Any, up: Any, pairs: Any, h: Any, book: Any, gate_bias: Any, up_bias: Any,
        k: Any, E: Any, F: Any, g_slot: Any, u_slot: Any, g_row: Any, u_row: Any,
        QT_G: tl.constexpr, QK_G: tl.constexpr, TS_G: tl.constexpr,
        QT_U: tl.constexpr, QK_U: tl.constexpr, TS_U: tl.constexpr,
        ACT: tl.constexpr, BIAS: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
    ) -> None:  # fmt: skip
        p = tl.program_id(0)
        flat = tl.load(pairs + 3 * p)  # t * k + j
        slot = tl.load(pairs + 3 * p + 1).to(tl.int64)
        expert = tl.load(pairs + 3 * p + 2).to(tl.int64)
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rm = rows < F
        xr = x + (flat // k).to(tl.int64) * E
        g = _row_dots(gate + slot * g_slot, g_row, rows, rm, xr, E, book, QT_G, QK_G, TS_G, C)
        u = _row_dots(up + slot * u_slot, u_row, rows, rm, xr, E, book, QT_U, QK_U, TS_U, C)
        if BIAS:
            g += tl.load(gate_bias + expert * F + rows, mask=rm, other=0.0)
            u += tl.load(up_bias + expert * F + rows, mask=rm, other=0.0)
        tl.store(h + p.to(tl.int64) * F + rows, _act(g, u, ACT), mask=rm)

    @triton.jit
    def _down_kernel(
        h: Any, down: Any, pairs: Any, weights: Any, out: Any, book: Any, bias: Any,
        E: Any, F: Any, d_slot: Any, d_row: Any,
        QT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, BIAS: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
    ) -> None:  # fmt: skip
        p = tl.program_id(0)
        flat = tl.load(pairs + 3 * p).to(tl.int64)
        slot = tl.load(pairs + 3 * p + 1).to(tl.int64)
        expert = tl.load(pairs + 3 * p + 2).to(tl.int64)
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rm = rows < E
        y = _row_dots(down + slot * d_slot, d_row, rows, rm, h + p.to(tl.int64) * F, F, book, QT, QK, TS, C)
        if BIAS:
            y += tl.load(bias + expert * E + rows, mask=rm, other=0.0)
        tl.store(out + flat * E + rows, y * tl.load(weights + flat), mask=rm)

    @triton.jit
    def _combine_kernel(dev: Any, host: Any, order: Any, out: Any, k: Any, E: Any, R: tl.constexpr) -> None:
        t = tl.program_id(0)
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rm = rows < E
        acc = tl.zeros([R], dtype=tl.float32)
        for j in range(0, k):
            code = tl.load(order + t * k + j).to(tl.int64)  # 2 * row + (1 if the CPU computed it)
            at = (code >> 1) * E + rows
            from_dev = tl.load(dev + at, mask=rm, other=0.0)
            from_host = tl.load(host + at, mask=rm, other=0.0)
            acc += tl.where((code & 1) == 1, from_host, from_dev)
        tl.store(out + t.to(tl.int64) * E + rows, acc, mask=rm)

    @triton.jit
    def _dense_kernel(
        x: Any, w: Any, out: Any, book: Any, K: Any, N: Any, row_bytes: Any,
        QT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
    ) -> None:  # fmt: skip
        """out[t, rows] = W[rows] @ x[t]: grid (tokens, row tiles)."""
        t = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * R + tl.arange(0, R)
        rm = rows < N
        tl.store(out + t * N + rows, _row_dots(w, row_bytes, rows, rm, x + t * K, K, book, QT, QK, TS, C), mask=rm)

    @triton.jit
    def _dequant_kernel(
        w: Any, out: Any, book: Any, K: Any, N: Any, row_bytes: Any,
        QT: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
    ) -> None:  # fmt: skip
        """out [N, K] float32 = the matrix decoded: grid (row tiles, column tiles)."""
        rows = tl.program_id(0) * R + tl.arange(0, R)
        col = tl.program_id(1) * C + tl.arange(0, C)[None, :]
        m = (rows < N)[:, None] & (col < K)
        base = w + rows[:, None].to(tl.int64) * row_bytes
        wt = _weights(base + (col // QK) * TS, col % QK, m, book, QT)
        tl.store(out + rows[:, None].to(tl.int64) * K + col, wt, mask=m)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Every launch goes through here (the tests count them)."""
    kernel[grid](*args, **meta)


_books: dict[torch.device, torch.Tensor] = {}


def _book(device: torch.device) -> torch.Tensor:
    if device not in _books:
        _books[device] = torch.tensor(_CODE_BOOK, dtype=torch.float32, device=device)
    return _books[device]


def _layout(qtype: GGMLQuantizationType) -> tuple[int, int, int]:
    block, size = GGML_QUANT_SIZES[qtype]
    return int(qtype), block, size


def pair_table(ids: np.ndarray, slot_of: np.ndarray, on_device: np.ndarray) -> tuple[np.ndarray, int]:
    """The int32 table the kernels read, built on the host from the ids already there.

    ids [T, k]; slot_of [n_expert] (-1: no slot); on_device [n_expert] bool: which experts the
    device computes. Returns (table, P): table[:3P] = (t*k + j, slot, expert) for each device
    pair, then [T*k]: per token, its rows in ascending expert order, coded 2*row + (1 if the CPU
    computed it).
    """
    n_tok, k = ids.shape
    flat = ids.reshape(-1)
    dev_rows = np.flatnonzero(on_device[flat])
    pairs = np.stack([dev_rows, slot_of[flat[dev_rows]], flat[dev_rows]], axis=1)
    order = np.argsort(ids, axis=1, kind="stable") + (np.arange(n_tok)[:, None] * k)  # [T, k] rows
    codes = 2 * order + (~on_device[flat[order]]).astype(np.int64)
    return np.concatenate([pairs.reshape(-1), codes.reshape(-1)]).astype(np.int32), int(dev_rows.size)


def run_layer(
    banks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    qtypes: tuple[GGMLQuantizationType, GGMLQuantizationType, GGMLQuantizationType],
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    act: int,
    x: torch.Tensor,
    weights: torch.Tensor,
    table: torch.Tensor,
    n_pairs: int,
    k: int,
    host_part: Callable[[], torch.Tensor | None],
) -> torch.Tensor:
    """One MoE layer's experts on the device: [T, E] = per token, its k weighted expert outputs summed.

    banks: (gate, up, down) slots [S, rows, row_bytes] uint8; x [T, E] float32 and weights [T, k]
    float32 on the device; table: `pair_table`'s, on the device. `host_part()` runs after the
    device work is queued (on CUDA the CPU share overlaps with it): the CPU share's contributions
    [T*k, E] on the device, or None when the CPU computes nothing.
    """
    gate, up, down = banks
    n_tok, e_dim = x.shape
    f_dim = gate.shape[1]
    book = _book(x.device)
    r = BLOCK_R if x.is_cuda else INTERPRET_R
    contrib = torch.empty((n_tok * k, e_dim), dtype=torch.float32, device=x.device)  # [T*k, E]
    if n_pairs:
        h = torch.empty((n_pairs, f_dim), dtype=torch.float32, device=x.device)  # [P, F]
        gb, ub, db = biases
        qt_g, qk_g, ts_g = _layout(qtypes[0])
        qt_u, qk_u, ts_u = _layout(qtypes[1])
        qt_d, qk_d, ts_d = _layout(qtypes[2])
        launch(_gate_up_kernel, (n_pairs, triton.cdiv(f_dim, r)),
               x, gate, up, table, h, book, gb if gb is not None else book, ub if ub is not None else book,
               k, e_dim, f_dim, gate.shape[1] * gate.shape[2], up.shape[1] * up.shape[2], gate.shape[2], up.shape[2],
               QT_G=qt_g, QK_G=qk_g, TS_G=ts_g, QT_U=qt_u, QK_U=qk_u, TS_U=ts_u, ACT=act, BIAS=gb is not None,
               R=r, C=COLS)  # fmt: skip
        launch(_down_kernel, (n_pairs, triton.cdiv(e_dim, r)),
               h, down, table, weights, contrib, book, db if db is not None else book,
               e_dim, f_dim, down.shape[1] * down.shape[2], down.shape[2],
               QT=qt_d, QK=qk_d, TS=ts_d, BIAS=db is not None, R=r, C=COLS)  # fmt: skip
    host = host_part()
    out = torch.empty((n_tok, e_dim), dtype=torch.float32, device=x.device)  # [T, E]
    launch(_combine_kernel, (n_tok, triton.cdiv(e_dim, r)),
           contrib, contrib if host is None else host, table[3 * n_pairs :], out, k, e_dim, R=r)  # fmt: skip
    return out


DECODE_TILE_BYTES = 64 << 20  # float32 bytes of one decoded tile of a dense matrix


def dense(raw: torch.Tensor, qtype: GGMLQuantizationType, x: torch.Tensor) -> torch.Tensor:
    """x [T, K] float32 @ W.T for W's blocks raw [N, row_bytes] uint8 on the device -> [T, N] float32.

    Few tokens (decode): one launch that reads each row's blocks once per token. Many (prefill): the
    matrix decoded a tile of rows at a time into float32, then a GEMM: the weights are read once.
    """
    n_rows, row_bytes = raw.shape
    n_tok, k_dim = x.shape
    qt, qk, ts = _layout(qtype)
    book = _book(x.device)
    r = BLOCK_R if x.is_cuda else INTERPRET_R
    if n_tok < GEMM_TOKENS:
        out = torch.empty((n_tok, n_rows), dtype=torch.float32, device=x.device)
        launch(_dense_kernel, (n_tok, triton.cdiv(n_rows, r)), x, raw, out, book, k_dim, n_rows, row_bytes,
               QT=qt, QK=qk, TS=ts, R=r, C=COLS)  # fmt: skip
        return out
    out = torch.empty((n_tok, n_rows), dtype=torch.float32, device=x.device)
    tile = max(r, DECODE_TILE_BYTES // (4 * k_dim) // r * r)
    for start in range(0, n_rows, tile):
        part = raw[start : start + tile]
        w = torch.empty((part.shape[0], k_dim), dtype=torch.float32, device=x.device)
        launch(_dequant_kernel, (triton.cdiv(part.shape[0], r), triton.cdiv(k_dim, COLS)), part, w, book, k_dim,
               part.shape[0], row_bytes, QT=qt, QK=qk, TS=ts, R=r, C=COLS)  # fmt: skip
        out[:, start : start + part.shape[0]] = x @ w.T
    return out
