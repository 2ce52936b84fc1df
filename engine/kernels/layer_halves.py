"""A layer's halves for one new token on the CPU, each in one compiled call.

At one token a layer is dozens of tiny eager torch ops, each costing more than its work. Here
each half is one numba call. `AttentionBlockCall` takes the residual stream x and returns x plus
the attention's output: RMS norm, the q, k and v projections (from the file's blocks, one
parallel region), biases and per-head q/k norms where the model has them, rotary embedding, the
KV cache write, attention over the cached positions (grouped-query, optionally a sliding window),
the output projection (a second parallel region), a post-attention norm where the model has one
(Gemma), and the residual add. `decode_attention` is the part between the projections.
`FfnBlockCall` does the same for a dense gated FFN (RMS norm, gate and up with the activation, down,
post-norm, residual add), or without norm and residual for a MoE layer's shared expert.
`rms_rows` and `route_rows` are a few rows' RMS norm and a MoE layer's routing.

Prefill and logit soft-capping keep the torch path (`layers.attention`), which is also the
reference the tests hold this one to; attention sinks (gpt-oss) are in both.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from llvmlite import ir

from .attention_core import LANES, fits, key_scores, row_scores, rows_fit, weighted_values
from .codes import GATING_SELECT, GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_SELECTED
from .cpu import ROWS, act, dots
from .jit import intrinsic, njit, prange, types
from .qblocks import quantize_rows, sum_squares

FEW_ROWS = 8  # up to this many rows (decode), RMS norm and routing run as compiled calls


@njit(inline="always")
def _rotate(x: np.ndarray, cis: np.ndarray, pos: int, neox: bool) -> None:
    """Rotary embedding of the first 2 * cis.shape[1] values of each row of x [H, D], in place."""
    half = cis.shape[1]
    for h in range(x.shape[0]):
        for i in range(half):
            c, s = cis[pos, i, 0], cis[pos, i, 1]
            j, k = (i, i + half) if neox else (2 * i, 2 * i + 1)
            a, b = x[h, j], x[h, k]
            x[h, j] = a * c - b * s
            x[h, k] = a * s + b * c


@njit(inline="always")
def _rms(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out = x / rms(x) * w over the last axis of x [R, D] (w [D])."""
    for r in range(x.shape[0]):
        ss = sum_squares(x, r, x.shape[1])
        inv = np.float32(1) / np.sqrt(ss / np.float32(x.shape[1]) + np.float32(eps))
        for d in range(x.shape[1]):
            out[r, d] = x[r, d] * inv * w[d]


@njit
def rms_compiled(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rms_rows in compiled code (the one function every compiled caller uses: the same bits everywhere)."""
    out = np.empty_like(x)
    _rms(x, w, eps, out)
    return out


def rms_rows(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMS norm of each row of x [R, D] (float32) times w [D]: one compiled call, for a few rows."""
    return rms_compiled(x, w, np.float32(eps))


def _check_positions(lowest: int, highest: int, n_ctx: int) -> None:
    """Positions lowest..highest inside a cache of n_ctx: compiled code does not check bounds, and a position past
    the cache would write outside it."""
    if not 0 <= lowest <= highest < n_ctx:
        raise IndexError(f"position {lowest if lowest < 0 else highest} is outside the KV cache of {n_ctx} positions")


def _f32_from_bits_typing(typingctx: Any, bits: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


_f32_from_bits: Any = intrinsic(_f32_from_bits_typing)  # the float32 whose bit pattern is an int32's


@njit(inline="always", fastmath={"reassoc", "contract"})
def exp_nonpositive(x: float) -> float:
    """exp(x) for x <= 0 (a softmax's shifted logits): within 2e-7 relative down to -87, 0 below -87.7
    (exp leaves float32's normal range there).

    libm's exp is a call per element, which keeps the loop around it scalar: over a long context the
    softmax took as long as the dot products. Here exp(x) = 2^n exp(r), n = round(x / ln 2), r = x -
    n ln 2 (ln 2 in two parts, so r keeps its bits), |r| <= ln 2 / 2, exp(r) by its Taylor series to
    degree 7, and 2^n written into the exponent.
    """
    # Below -88 (and for NaN) as at -88: n = -127 there, the exponent's bits are 0, and so is the result.
    xc = x if x > np.float32(-88.0) else np.float32(-88.0)
    n = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - n * np.float32(0.693145751953125)
    r = r - n * np.float32(1.4286068203094173e-06)
    p = np.float32(1.0 / 5040)
    p = p * r + np.float32(1.0 / 720)
    p = p * r + np.float32(1.0 / 120)
    p = p * r + np.float32(1.0 / 24)
    p = p * r + np.float32(1.0 / 6)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(inline="always", fastmath={"reassoc", "contract"})
def _key_scores_loops(q, k_cache, kv, h0, per, start, n, scale, p):
    """attention_core.key_scores for any shape: four positions a pass (four independent sums per q row)."""
    dim, n4 = q.shape[1], n - n % 4
    for s in range(0, n4, 4):
        a, b, c, e = start + s, start + s + 1, start + s + 2, start + s + 3
        for j in range(per):
            d0 = d1 = d2 = d3 = np.float32(0)
            for d in range(dim):
                x = q[h0 + j, d]
                d0 += x * k_cache[kv, a, d]
                d1 += x * k_cache[kv, b, d]
                d2 += x * k_cache[kv, c, d]
                d3 += x * k_cache[kv, e, d]
            p[j, s], p[j, s + 1], p[j, s + 2], p[j, s + 3] = d0 * scale, d1 * scale, d2 * scale, d3 * scale
    for s in range(n4, n):
        for j in range(per):
            d0 = np.float32(0)
            for d in range(dim):
                d0 += q[h0 + j, d] * k_cache[kv, start + s, d]
            p[j, s] = d0 * scale


@njit(inline="always", fastmath={"reassoc", "contract"})
def _weighted_values_loops(p, v_cache, kv, h0, per, start, n, out):
    """attention_core.weighted_values for any shape."""
    dim_v, n4 = v_cache.shape[2], n - n % 4
    acc = np.zeros((per, dim_v), np.float32)  # [per, Dv]
    for s in range(0, n4, 4):
        a, b, c, e = start + s, start + s + 1, start + s + 2, start + s + 3
        for j in range(per):
            w0, w1, w2, w3 = p[j, s], p[j, s + 1], p[j, s + 2], p[j, s + 3]
            for d in range(dim_v):
                acc[j, d] += (w0 * v_cache[kv, a, d] + w1 * v_cache[kv, b, d] + w2 * v_cache[kv, c, d]
                              + w3 * v_cache[kv, e, d])  # fmt: skip
    for s in range(n4, n):
        for j in range(per):
            w0 = p[j, s]
            for d in range(dim_v):
                acc[j, d] += w0 * v_cache[kv, start + s, d]
    out[h0 : h0 + per] = acc


# Work items are (KV head, its query heads): each cached k and v row is read once for the heads that
# share it (`attention_core`; loops for the shapes it does not take). With fewer than four KV heads
# each query head is an item of its own, so two threads still share the work. The softmax's exp is
# inlined (`exp_nonpositive`). The order of every sum is fixed by the compiled code, so every call
# (cache on or off) gives the same bits.
@njit(parallel=True, fastmath={"reassoc", "contract"})
def _decode_attention(q, k, v, cis, neox, k_cache, v_cache, pos, start, scale, sinks, out):
    """q [H, D], k [Hkv, D], v [Hkv, Dv] of the token at `pos` -> out [H, Dv]; writes the cache at pos.
    sinks [H] (or empty): each head's logit that takes part in the softmax and has no value."""
    _rotate(q, cis, pos, neox)
    _rotate(k, cis, pos, neox)
    k_cache[:, pos] = k
    v_cache[:, pos] = v
    n_head, n_kv = q.shape[0], k.shape[0]
    group = n_head // n_kv
    per = group if n_kv >= 4 else 1  # query heads per work item
    n = pos + 1 - start
    vector = fits(q, k_cache, v_cache, n)
    for item in prange(n_head // per):
        h0 = item * per
        kv = h0 // group
        p = np.empty((per, n), np.float32)  # [per, n] the heads' scores, then weights
        if vector:
            key_scores(q, k_cache, kv, h0, per, start, n, scale, p)
        else:
            _key_scores_loops(q, k_cache, kv, h0, per, start, n, scale, p)
        for j in range(per):
            top = sinks[h0 + j] if sinks.size else np.float32(-np.inf)
            for s in range(n):
                top = max(top, p[j, s])
            total = exp_nonpositive(sinks[h0 + j] - top) if sinks.size else np.float32(0)
            for s in range(n):
                w = exp_nonpositive(p[j, s] - top)
                p[j, s] = w
                total += w
            inv = np.float32(1) / total
            for s in range(n):
                p[j, s] *= inv
        if vector:
            weighted_values(p, v_cache, kv, h0, per, start, n, out)
        else:
            _weighted_values_loops(p, v_cache, kv, h0, per, start, n, out)


def decode_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, cis: np.ndarray, neox: bool, k_cache: np.ndarray,
    v_cache: np.ndarray, pos: int, window: int, scale: float, sinks: np.ndarray | None = None,
) -> np.ndarray:  # fmt: skip
    """One token's attention: q [H, D], k [Hkv, D], v [Hkv, Dv] (rotated here, in place) -> [H, Dv].

    cis [n_ctx, rope_dim / 2, 2]: cos and sin per position; k_cache/v_cache [Hkv, n_ctx, D]: the
    layer's cache (`nn.layers.host_heads`), written at `pos`; window: 0, or the sliding window's length;
    sinks [H]: the heads' attention sinks (gpt-oss), or None.
    """
    _check_positions(pos, pos, k_cache.shape[1])
    start = max(0, pos - window + 1) if window else 0
    out = np.empty((q.shape[0], v.shape[1]), np.float32)
    _decode_attention(q, k, v, cis, neox, k_cache, v_cache, pos, start, np.float32(scale),
                      _NONE if sinks is None else sinks, out)  # fmt: skip
    return out


@njit(inline="always")
def _project_rows(code: int, w: np.ndarray, q: Any, k: int, n: int, r0: int, y: np.ndarray) -> None:
    """y[t, r] = row r of w times quantized activation row t of q (k values), for the n rows t and the ROWS
    rows r from r0 (a work item): a row of w is read once for all n, its chunks unpacked once for four tokens
    (`cpu.dots`). Each y[t, r] is the product row t gets alone (`qblocks.dot_row`): the same bits whatever n is."""
    tokens = np.arange(n)
    acc = np.empty(n, np.float32)
    for r in range(r0, min(w.shape[0], r0 + ROWS)):
        dots(code, w, r * w.strides[0], k, q, tokens, 0, n, acc)
        for t in range(n):
            y[t, r] = acc[t]


@functools.cache
def _block_kernel(tq: Q, tk: Q, tv: Q, to: Q, bits: int) -> Any:
    cq, ck, cv, co = int(tq), int(tk), int(tv), int(to)

    @njit(parallel=True, fastmath=False)
    def block(x, norm, eps, wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm, post_norm, n_head, n_kv, head_dim,
              cis, neox, k_bank, v_bank, slots, pos, start, scale, sinks, out):  # fmt: skip
        n, e = x.shape
        h = np.empty((n, e), np.float32)
        _rms(x, norm, eps, h)
        qa = quantize_rows(h, np.arange(n), bits)
        nq, nk, nv = wq.shape[0], wk.shape[0], wv.shape[0]
        tiles_q, tiles_k = (nq + ROWS - 1) // ROWS, (nk + ROWS - 1) // ROWS
        yq, yk, yv = np.empty((n, nq), np.float32), np.empty((n, nk), np.float32), np.empty((n, nv), np.float32)
        for job in prange(tiles_q + tiles_k + (nv + ROWS - 1) // ROWS):
            if job < tiles_q:
                _project_rows(cq, wq, qa, e, n, job * ROWS, yq)
            elif job < tiles_q + tiles_k:
                _project_rows(ck, wk, qa, e, n, (job - tiles_q) * ROWS, yk)
            else:
                _project_rows(cv, wv, qa, e, n, (job - tiles_q - tiles_k) * ROWS, yv)
        dim_v = v_bank.shape[3]
        a = np.empty((n, n_head * dim_v), np.float32)
        for t in range(n):  # each row over its own sequence's cache, at its own position
            if bq.size:
                yq[t] += bq
                yk[t] += bk
                yv[t] += bv
            q = yq[t].reshape(n_head, head_dim)
            k = yk[t].reshape(n_kv, head_dim)
            if q_norm.size:
                _rms(q.copy(), q_norm, eps, q)
            if k_norm.size:
                _rms(k.copy(), k_norm, eps, k)
            s = slots[t]
            _decode_attention(q, k, yv[t].reshape(n_kv, dim_v), cis, neox, k_bank[s], v_bank[s], pos[t], start[t],
                              scale, sinks, a[t].reshape(n_head, dim_v))  # fmt: skip
        qo = quantize_rows(a, np.arange(n), bits)
        y = np.empty((n, e), np.float32)
        for job in prange((e + ROWS - 1) // ROWS):
            _project_rows(co, wo, qo, a.shape[1], n, job * ROWS, y)
        if bo.size:
            for t in range(n):
                y[t] += bo
        if post_norm.size:
            _rms(y.copy(), post_norm, eps, y)
        for t in range(n):
            for r in range(e):
                out[t, r] = x[t, r] + y[t, r]

    return block


class AttentionBlockCall:
    """A layer's attention block for a decode step's tokens, everything but the tokens and their KV caches bound
    once.

    norm, eps: the pre-attention RMS norm; ws: (raw bytes, type) of q, k, v and output; biases: of
    q, k, v, output (None: none; q, k and v have them all or none); q_norm/k_norm: per-head weights
    [head_dim]; post_norm: the norm after the output projection; shape: (heads, KV heads,
    head_dim); cis and neox: as for decode_attention; window: 0, or the sliding window's length;
    bits: the activations' integers in the products (8 or 16); sinks: as for decode_attention.
    Called with (x [1, E], k_cache, v_cache, pos) -> x + the attention of its normed self at pos; `rows` takes
    n tokens of as many sequences, each over its slot of a bank of caches. A token computes the same bits
    alone and among others: one kernel serves both, its rows apart in every step.
    """

    def __init__(
        self, norm: np.ndarray, eps: float, ws: tuple[tuple[np.ndarray, Q], ...],
        biases: tuple[np.ndarray | None, ...], q_norm: np.ndarray | None, k_norm: np.ndarray | None,
        post_norm: np.ndarray | None, shape: tuple[int, int, int], cis: np.ndarray, neox: bool, window: int,
        scale: float, bits: int = 16, sinks: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        (wq, tq), (wk, tk), (wv, tv), (wo, to) = ws
        bq, bk, bv, bo = (_NONE if b is None else b for b in biases)
        self.window = window
        self.kernel = _block_kernel(tq, tk, tv, to, bits)
        self.head = (norm, np.float32(eps), wq, wk, wv, wo, bq, bk, bv, bo, _NONE if q_norm is None else q_norm,
                     _NONE if k_norm is None else k_norm, _NONE if post_norm is None else post_norm, *shape, cis,
                     neox)  # fmt: skip
        self.tail = (np.float32(scale), _NONE if sinks is None else sinks)

    def __call__(self, x: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos: int) -> np.ndarray:
        """One token x [1, E] over the layer's cache k_cache/v_cache [Hkv, n_ctx, D] at `pos`."""
        return self.rows(x, k_cache[None], v_cache[None], _ZERO, np.array([pos], np.int64))

    def rows(self, x: np.ndarray, k_bank: np.ndarray, v_bank: np.ndarray, slots: np.ndarray,
             pos: np.ndarray) -> np.ndarray:  # fmt: skip
        """n tokens x [n, E] of n sequences: token t over slot slots[t] of the bank k_bank/v_bank [S, Hkv, n_ctx,
        D] at position pos[t] (int64 arrays [n]) -> [n, E]."""
        _check_positions(int(pos.min()), int(pos.max()), k_bank.shape[2])
        start = np.maximum(0, pos - self.window + 1) if self.window else np.zeros_like(pos)
        out = np.empty_like(x)
        self.kernel(x, *self.head, k_bank, v_bank, slots, pos, start, *self.tail, out)
        return out


_ZERO = np.zeros(1, np.int64)
_NONE = np.zeros(0, np.float32)


@njit(inline="always")
def _ffn(cg, cu, cd, bits, h, gate, up, down, code, y):
    """y [n, E] = down @ act(gate @ h, up @ h) for n tokens h [n, E]: two parallel regions, each row of the
    matrices read once for all n tokens (each token's products the same bits as alone)."""
    n, e, f = h.shape[0], h.shape[1], gate.shape[0]
    rows = np.arange(n)
    qh = quantize_rows(h, rows, bits)
    g = np.empty((n, f), np.float32)
    for job in prange((f + ROWS - 1) // ROWS):
        gv, uv = np.empty(n, np.float32), np.empty(n, np.float32)
        for r in range(job * ROWS, min(f, job * ROWS + ROWS)):
            dots(cg, gate, r * gate.strides[0], e, qh, rows, 0, n, gv)
            dots(cu, up, r * up.strides[0], e, qh, rows, 0, n, uv)
            for t in range(n):
                g[t, r] = act(code, gv[t], uv[t])
    qg = quantize_rows(g, rows, bits)
    for job in prange((e + ROWS - 1) // ROWS):
        _project_rows(cd, down, qg, f, n, job * ROWS, y)


@functools.cache
def _ffn_kernel(tg: Q, tu: Q, td: Q, bits: int) -> Any:
    cg, cu, cd = int(tg), int(tu), int(td)

    @njit(parallel=True, fastmath=False)
    def block(x, norm, eps, gate, up, down, code, post_norm, residual, out):
        h = np.empty_like(x)
        if norm.size:
            _rms(x, norm, eps, h)
        else:
            h[:] = x
        y = np.empty_like(x)
        _ffn(cg, cu, cd, bits, h, gate, up, down, code, y)
        if post_norm.size:
            _rms(y.copy(), post_norm, eps, y)
        for t in range(x.shape[0]):
            for r in range(x.shape[1]):
                out[t, r] = y[t, r] + (x[t, r] if residual else np.float32(0))

    return block


class FfnBlockCall:
    """A dense FFN block for a decode step's tokens, everything but the tokens bound once: x [n, E] -> x (+ if
    residual) post_norm(down @ act(gate @ h, up @ h)), h = rms_norm(x) (x itself if norm is None), each row the
    same bits as alone. ws: (raw bytes, type) of gate, up and down; code: `cpu_kernels.ACT_*`; bits: as for
    AttentionBlockCall."""

    def __init__(
        self, norm: np.ndarray | None, eps: float, ws: tuple[tuple[np.ndarray, Q], ...], code: int,
        post_norm: np.ndarray | None = None, residual: bool = True, bits: int = 16,
    ) -> None:  # fmt: skip
        (gate, tg), (up, tu), (down, td) = ws
        self.kernel = _ffn_kernel(tg, tu, td, bits)
        self.head = (_NONE if norm is None else norm, np.float32(eps), gate, up, down, code)
        self.tail = (_NONE if post_norm is None else post_norm, residual)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        self.kernel(x, *self.head, *self.tail, out)
        return out


# The logits over the kernel's threads: a router's float32 rows are a megabyte a layer (Qwen3-30B's
# 128 x 2048). Each logit is a dot product of E numbers: summed in order, one dependent add after
# another, it waited on the adder's latency (0.15 ms a layer, more than the megabyte's read). In
# whole vectors the rows take `attention_core.row_scores` (LANES rows a block, a vector accumulator
# per row, their order fixed by the code); other shapes keep the loop. One compiled function serves
# every caller (route_rows, the one-call MoE layer): the same code, the same bits.
@njit(parallel=True, fastmath=False)
def router_logits(h, router, router_bias):
    """Router logits [T, n_expert] of h [T, E] and router [n_expert, E] (+ router_bias, or an empty one)."""
    n = router.shape[0]
    logits = np.empty((h.shape[0], n), np.float32)
    if rows_fit(h, router):
        for block in prange((n + LANES - 1) // LANES):
            row_scores(h, router, block, logits)
    else:
        for e in prange(n):
            for t in range(h.shape[0]):
                acc = np.float32(0)
                for d in range(h.shape[1]):
                    acc += h[t, d] * router[e, d]
                logits[t, e] = acc
    if router_bias.size:
        for t in range(h.shape[0]):
            for e in range(n):
                logits[t, e] += router_bias[e]
    return logits


@njit
def route_compiled(h, router, router_bias, gating, k, weights_norm, scale):
    """route_rows in compiled code: ids int64 [T, k], weights float32 [T, k]."""
    return select_compiled(router_logits(h, router, router_bias), gating, k, weights_norm, scale, _NONE, 1, 1)


@njit(inline="always")
def _take_largest(values, k, taken, out):
    """out[:k] = the indices of the k largest values, descending; a tie goes to the lower index. `taken`
    (as long as values, all False) marks them."""
    for j in range(k):
        best = -1
        for e in range(values.shape[0]):
            if not taken[e] and (best < 0 or values[e] > values[best]):
                best = e
        taken[best] = True
        out[j] = best


@njit
def select_compiled(logits, gating, k, weights_norm, scale, choice_bias, n_groups, groups_used):
    """The routing rule of every family, as `moe.routing.route` computes it in torch: the k experts of each row of
    router logits [T, n_expert] and their weights, ids int64 [T, k], weights float32 [T, k].

    `gating` turns the logits into probabilities (softmax, sigmoid, or none: the selected ones are
    softmaxed after, or, selection only, the plain top k weighing 1 each); `choice_bias` (empty: none)
    is added to them for the choice only; with `n_groups` > 1 only the `groups_used` groups whose two
    best scores sum highest compete. The weights are the chosen experts' probabilities, normalised to
    sum 1 where `weights_norm`, times `scale`."""
    t_n, n = logits.shape
    ids = np.empty((t_n, k), np.int64)
    weights = np.empty((t_n, k), np.float32)
    per_group = n // n_groups
    for t in range(t_n):
        probs = logits[t].copy()
        if gating == GATING_SOFTMAX:
            probs = np.exp(logits[t] - logits[t].max())
            probs /= probs.sum()
        elif gating == GATING_SIGMOID:
            probs = np.float32(1) / (np.float32(1) + np.exp(-logits[t]))
        select_only = gating == GATING_SELECT  # the plain top k of the logits: no bias, no groups
        scores = probs + choice_bias if choice_bias.size and not select_only else probs
        taken = np.zeros(n, np.bool_)
        if n_groups > 1 and not select_only:  # a group's score: the sum of its two best; the others' experts are out
            group_scores = np.empty(n_groups, np.float32)
            two = np.empty(2, np.int64)
            for g in range(n_groups):
                part = scores[g * per_group : (g + 1) * per_group]
                _take_largest(part, 2, np.zeros(per_group, np.bool_), two)
                group_scores[g] = part[two[0]] + part[two[1]]
            kept = np.zeros(n_groups, np.bool_)
            _take_largest(group_scores, groups_used, kept, np.empty(groups_used, np.int64))
            for g in range(n_groups):
                if not kept[g]:
                    taken[g * per_group : (g + 1) * per_group] = True  # never chosen
        _take_largest(scores, k, taken, ids[t])
        for j in range(k):
            weights[t, j] = probs[ids[t, j]]
        if select_only:  # every weight 1, unscaled
            weights[t, :] = 1
            continue
        if gating == GATING_SOFTMAX_SELECTED:
            w = np.exp(weights[t] - weights[t].max())
            weights[t, :] = w / w.sum()
        elif weights_norm:
            weights[t, :] = weights[t] / weights[t].sum()
        weights[t, :] *= scale
    return ids, weights


def route_rows(h: np.ndarray, router: np.ndarray, router_bias: np.ndarray | None, gating: int, k: int,
               weights_norm: bool, scale: float, choice_bias: np.ndarray | None = None, n_groups: int = 1,
               groups_used: int = 1) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """A few tokens' routing in compiled calls, as `moe.route(h @ router.T + bias, cfg, choice_bias)` computes
    it: ids int64 [T, k] by descending score, weights float32 [T, k]. Each row is routed on its own (the same
    bits alone and among others)."""
    bias = _NONE if router_bias is None else router_bias
    if choice_bias is None and n_groups == 1:
        return route_compiled(h, router, bias, gating, k, weights_norm, np.float32(scale))
    return select_compiled(router_logits(h, router, bias), gating, k, weights_norm, np.float32(scale),
                           _NONE if choice_bias is None else choice_bias, n_groups, groups_used)  # fmt: skip


@njit(parallel=True)
def _delta_rule(q, k, v, decay, beta, state, out):
    n_tok, n_head, dk = q.shape
    dv = v.shape[2]
    for h in prange(n_head):
        s = state[h]  # [Dk, Dv]: this head's state, updated in place
        mem = np.empty(dv, np.float32)
        for t in range(n_tok):
            g, b = decay[t, h], beta[t, h]
            mem[:] = 0
            for i in range(dk):  # decay, and what the state recalls for this key
                ki = k[t, h, i]
                for j in range(dv):
                    s[i, j] *= g
                    mem[j] += ki * s[i, j]
            for j in range(dv):
                mem[j] = (v[t, h, j] - mem[j]) * b  # the correction to write
            for j in range(dv):
                out[t, h, j] = 0
            for i in range(dk):  # write the correction along the key, read along the query
                ki, qi = k[t, h, i], q[t, h, i]
                for j in range(dv):
                    s[i, j] += ki * mem[j]
                    out[t, h, j] += qi * s[i, j]


def delta_rule_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray,
                    state: np.ndarray) -> np.ndarray:  # fmt: skip
    """The gated delta rule over T tokens, heads in parallel: q, k [T, H, Dk], v [T, H, Dv],
    decay and beta [T, H]; `state` [H, Dk, Dv] is updated in place. -> [T, H, Dv].

    Per token and head the state passes through the cache twice (decay with the key's recall,
    then the write with the query's read) instead of the six whole-state ops of the torch form."""
    out = np.empty(v.shape, np.float32)
    _delta_rule(q, k, v, decay, beta, state, out)
    return out
