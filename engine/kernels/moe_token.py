"""A MoE layer's routing and routed experts for one token in one compiled call (decode, cache off).

The general path is five compiled calls and their Python between them (routing, the selection,
gate and up, down, the sum by token), about a tenth of a millisecond per layer at decode. Here
one call routes the normed token (`route_rows`' own compiled function), runs gate and up with the
activation for its k experts (one parallel region over (expert, tile of rows)), quantizes the k
intermediate rows, runs down times the routing weights (a second region), and sums the k rows in
ascending expert order. Every step is the one the general path takes, value for value, so the
result is bit-identical to it: with the expert cache on (the general path) or off (here), the
model computes the same.

`MoeTokenCall` binds everything but the token once; a decode layer's call also takes the FFN's norm
and the residual add (the same compiled norm a separate call runs, the same float add), so a layer
is two calls (`layer_halves.AttentionBlockCall`, then this) and next to no Python: after each call
has streamed megabytes of weights through the caches, every line of Python between calls runs from
cold caches, at up to tens of microseconds a call.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from .cpu import ROWS, act, dots
from .jit import njit, prange
from .layer_halves import rms_compiled, route_compiled
from .qblocks import dot_row, quantize_rows

_NO_BIAS = np.zeros((0, 0), np.float32)
_NONE = np.zeros(0, np.float32)  # an absent vector: no router bias, no norm


@njit(inline="always")
def _by_expert(ids):
    """The (token, choice) pairs of ids [n, k] grouped by expert: `pairs` (flat indices t * k + j, an expert's
    together, ascending token within one) and `bounds` (expert u's pairs are pairs[bounds[u]:bounds[u + 1]])."""
    flat = ids.ravel()
    pairs = np.argsort(flat, kind="mergesort")
    starts = [0]
    for i in range(1, pairs.size):
        if flat[pairs[i]] != flat[pairs[i - 1]]:
            starts.append(i)
    starts.append(pairs.size)
    return pairs, np.array(starts, np.int64)


@functools.cache
def _moe_kernel(tg: Q, tu: Q, td: Q, bits: int) -> Any:
    cg, cu, cd = int(tg), int(tu), int(td)

    @njit(parallel=True, fastmath=False)
    def moe(x, norm, eps, residual, router, router_bias, gating, k, weights_norm, scale, gate, up, down, bias_g, bias_u,
            bias_d, act_code, ids_out, w_out, y):  # fmt: skip
        # h: x, or its RMS norm by the compiled function rms_rows calls (its own float flags: the same bits)
        h = rms_compiled(x, norm, eps) if norm.size else x
        ids, w = route_compiled(h, router, router_bias, gating, k, weights_norm, scale)  # [n, k] each
        ids_out[:] = ids
        w_out[:] = w
        n, n_embd, n_ff = h.shape[0], h.shape[1], gate.shape[1]
        xq, dx, bs = quantize_rows(h, np.arange(n), bits)
        pairs, bounds = _by_expert(ids)  # each expert's blocks read once for every token routed to it
        flat, tok = ids.ravel(), pairs // k
        n_used = bounds.size - 1
        g = np.empty((n * k, n_ff), np.float32)  # [n*k, F]: act(gate, up) of each token's selected experts
        tiles = (n_ff + ROWS - 1) // ROWS
        for job in prange(n_used * tiles):
            u, r0 = job // tiles, job % tiles * ROWS
            lo, m = bounds[u], bounds[u + 1] - bounds[u]
            e = flat[pairs[lo]]
            gv, uv = np.empty(m, np.float32), np.empty(m, np.float32)
            for r in range(r0, min(n_ff, r0 + ROWS)):
                # the expert's row, its chunks unpacked once for four of its tokens (cpu.dots: each the bits alone)
                dots(cg, gate, e * gate.strides[0] + r * gate.strides[1], n_embd, (xq, dx, bs), tok, lo, m, gv)
                dots(cu, up, e * up.strides[0] + r * up.strides[1], n_embd, (xq, dx, bs), tok, lo, m, uv)
                for i in range(m):
                    a, b = gv[i], uv[i]
                    if bias_g.shape[0]:
                        a += bias_g[e, r]
                        b += bias_u[e, r]
                    g[pairs[lo + i], r] = act(act_code, a, b)
        gq, gd, gs = quantize_rows(g, np.arange(n * k), bits)
        contrib = np.empty((n * k, n_embd), np.float32)  # [n*k, E]: each selected expert's weighted output
        tiles = (n_embd + ROWS - 1) // ROWS
        for job in prange(n_used * tiles):
            u, r0 = job // tiles, job % tiles * ROWS
            lo, m = bounds[u], bounds[u + 1] - bounds[u]
            e = flat[pairs[lo]]
            dv = np.empty(m, np.float32)
            for r in range(r0, min(n_embd, r0 + ROWS)):
                dots(cd, down, e * down.strides[0] + r * down.strides[1], n_ff, (gq, gd, gs), pairs, lo, m, dv)
                for i in range(m):
                    p, v = pairs[lo + i], dv[i]
                    if bias_d.shape[0]:
                        v += bias_d[e, r]
                    contrib[p, r] = v * w[p // k, p % k]
        for t in range(n):
            y[t, :] = 0
            for j in np.argsort(ids[t], kind="mergesort"):
                y[t, :] += contrib[t * k + j]
            if residual:
                for r in range(n_embd):
                    y[t, r] = x[t, r] + y[t, r]

    return moe


class MoeTokenCall:
    """A MoE layer's routing and routed experts for a decode step's tokens, everything but the tokens bound once.

    Called on x [n, E] (float32): (ids int64 [n, k], weights float32 [n, k], y [n, E]) with y the
    experts' weighted sums, or with `norm` x + those sums of rms_norm(x) (a decode layer's FFN half).
    An expert's blocks are read once for every token routed to it, and each token's sum is the bits it gets
    alone. mats: the layer's stacked (gate, up, down) [n_expert, rows, row_bytes]; biases: per expert
    [n_expert, rows] or None; act_code: `codes.ACT_*`; bits: the activations'.
    """

    def __init__(
        self, router: np.ndarray, router_bias: np.ndarray | None, gating: int, k: int, weights_norm: bool,
        scale: float, mats: tuple[np.ndarray, np.ndarray, np.ndarray], types: tuple[Q, Q, Q],
        biases: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None], act_code: int, bits: int = 16,
        norm: np.ndarray | None = None, eps: float = 0.0,
    ) -> None:  # fmt: skip
        bg, bu, bd = (_NO_BIAS if b is None else b for b in biases)
        self.k = k
        self.kernel = _moe_kernel(*types, bits)
        self.head = (_NONE if norm is None else norm, np.float32(eps), norm is not None)
        self.tail = (router, _NONE if router_bias is None else router_bias, gating, k, weights_norm,
                     np.float32(scale), *mats, bg, bu, bd, act_code)  # fmt: skip

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # Every output is the caller's array: the kernel returns nothing. Arrays returned from it were once
        # boxed with a NULL dtype after other variants of it had run in the process (NRT_adapt_ndarray_to_python).
        n = x.shape[0]
        ids, w, y = np.empty((n, self.k), np.int64), np.empty((n, self.k), np.float32), np.empty_like(x)
        self.kernel(x, *self.head, *self.tail, ids, w, y)
        return ids, w, y


@functools.cache
def _experts_kernel(tg: Q, tu: Q, td: Q, bits: int) -> Any:
    cg, cu, cd = int(tg), int(tu), int(td)

    @njit(parallel=True, fastmath=False)
    def experts(h, ids, w, slots, todo, gate, up, down, bias_g, bias_u, bias_d, act_code, contrib):  # fmt: skip
        # `moe` after its routing, on the rows j with todo[j], reading expert ids[0, j] at matrix slots[j]
        k = ids.shape[1]
        n_embd, n_ff = h.shape[1], gate.shape[1]
        xq, dx, bs = quantize_rows(h, np.zeros(1, np.int64), bits)
        g = np.zeros((k, n_ff), np.float32)  # [k, F]; rows not computed now stay 0 (each row its own scales)
        tiles = (n_ff + ROWS - 1) // ROWS
        for job in prange(k * tiles):
            j, r0 = job // tiles, job % tiles * ROWS
            if todo[j]:
                e, s = ids[0, j], slots[j]
                for r in range(r0, min(n_ff, r0 + ROWS)):
                    gv = dot_row(cg, gate, s * gate.strides[0] + r * gate.strides[1], n_embd, xq, dx, bs, 0)
                    uv = dot_row(cu, up, s * up.strides[0] + r * up.strides[1], n_embd, xq, dx, bs, 0)
                    if bias_g.shape[0]:
                        gv += bias_g[e, r]
                        uv += bias_u[e, r]
                    g[j, r] = act(act_code, gv, uv)
        gq, gd, gs = quantize_rows(g, np.arange(k), bits)
        tiles = (n_embd + ROWS - 1) // ROWS
        for job in prange(k * tiles):
            j, r0 = job // tiles, job % tiles * ROWS
            if todo[j]:
                e, s = ids[0, j], slots[j]
                for r in range(r0, min(n_embd, r0 + ROWS)):
                    v = dot_row(cd, down, s * down.strides[0] + r * down.strides[1], n_ff, gq, gd, gs, j)
                    if bias_d.shape[0]:
                        v += bias_d[e, r]
                    contrib[j, r] = v * w[0, j]

    return experts


class TokenExperts:
    """One token's routed experts of a layer from banks of slots, in parts: `MoeTokenCall`'s arithmetic after
    its routing, value for value, so a layer computed in parts here equals it. Called on (h [1, E] float32
    normed, ids int64 [1, k], weights float32 [1, k], each expert's slot int64 [k], which rows to compute
    bool [k], contrib float32 [k, E]): fills the chosen rows of contrib with weight * expert(h); the rows
    summed in ascending expert order (`cpu.sum_by_token`) are the layer's output."""

    def __init__(self, types: tuple[Q, Q, Q], biases: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None],
                 act_code: int, bits: int = 16) -> None:  # fmt: skip
        self.kernel = _experts_kernel(*types, bits)
        self.biases = tuple(_NO_BIAS if b is None else b for b in biases)
        self.act_code = act_code

    def __call__(self, h: np.ndarray, ids: np.ndarray, w: np.ndarray, slots: np.ndarray, todo: np.ndarray,
                 mats: tuple[np.ndarray, np.ndarray, np.ndarray], contrib: np.ndarray) -> None:  # fmt: skip
        self.kernel(h, ids, w, slots, todo, *mats, *self.biases, self.act_code, contrib)
