"""A MoE layer's selected experts in three kernel calls: gate and up with the activation, down, the sum.

`run_fused` computes the weighted contribution of every (token, selected expert) pair among the
`experts` it is given, into rows `t * k + j` of `contrib` [T*k, E]: the host experts call it with
all of a layer's selected experts, the expert cache with its slots for the hits and with the host
copy for the misses left to the CPU, each part filling its own rows. `kernels.cpu.sum_by_token` then
sums each token's rows in ascending expert order, so the result never depends on where an
expert ran (cache on or off, any CPU share: bit-identical).

An activation runs in the kernel when it is registered here with a kernel code; a layer whose
activation or quant types have no kernel runs on the exact path (moe.run_experts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from ..gguf.quant_types import CPU, supports
from ..kernels import cpu as cpu_kernels
from ..nn.activations import activation_code
from .expert_tensors import LayerExperts


def fusable(lx: LayerExperts, act: Callable[..., object]) -> bool:
    return activation_code(act) is not None and all(supports(t.qtype, CPU) for t in (lx.gate, lx.up, lx.down))


def bias_rows(t: torch.Tensor | None) -> np.ndarray | None:
    """Per-expert biases [n_expert, rows] as the kernels take them."""
    return None if t is None else t.float().contiguous().numpy()


class TokenCall(NamedTuple):
    """A layer's experts as `kernels.moe_token.MoeTokenCall` binds them (bound once per layer)."""

    mats: tuple[np.ndarray, np.ndarray, np.ndarray]  # gate, up, down: [n_expert, rows, row bytes] each
    types: tuple[Q, Q, Q]
    biases: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]  # [n_expert, rows] each, or None
    act_code: int  # nn.activations' code of the gated activation
    bits: int  # the token's activations' width in the kernels (16 or 8)


def run_fused(
    lx: LayerExperts,
    mats: tuple[np.ndarray, np.ndarray, np.ndarray],
    slot_of: np.ndarray | None,
    act: int,
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    experts: Sequence[int] | np.ndarray | None,
    contrib: np.ndarray,
    bits: tuple[int, int] = (16, 16),
) -> None:
    """Fill contrib[t*k + j] = weights[t, j] * expert_{ids[t, j]}(x[t]) for the pairs whose expert is in `experts`
    (None: every pair).

    mats: (gate, up, down) stacked [S, rows, row_bytes]: the layer's experts (slot_of None) or a
    cache's slots (slot_of[e]: expert e's slot). x [T, E] float32; ids int64 and weights float32 [T, k];
    bits: the activations' integers in the kernels (8 or 16): gate and up's, down's.
    """
    chosen = _ALL if experts is None else np.asarray(experts, dtype=np.int64)
    a, eids, ptr, tokens, x_rows = cpu_kernels.selection(ids, chosen)
    if a.shape[0] == 0:
        return
    sel = eids if slot_of is None else slot_of[eids]
    gate, up, down = mats
    h = np.empty((ids.size, gate.shape[1]), np.float32)  # [T*k, F]; only the rows in `a` are set
    cpu_kernels.gate_up(gate, lx.gate.qtype, up, lx.up.qtype, x, x_rows, sel, eids, ptr, tokens, a, h, act,
                        bias_rows(lx.gate.bias), bias_rows(lx.up.bias), bits[0])  # fmt: skip
    cpu_kernels.matmul(down, lx.down.qtype, h, a, sel, eids, ptr, a, a, contrib, weights.reshape(-1),
                       bias_rows(lx.down.bias), bits[1])  # fmt: skip


_ALL = np.zeros(0, np.int64)


def layer_output(contrib: np.ndarray, ids: np.ndarray) -> torch.Tensor:
    """Each token's pair rows [T*k, E] summed in ascending expert order: the layer's output [T, E]."""
    return torch.from_numpy(cpu_kernels.sum_by_token(contrib, ids))


def host_arrays(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[np.ndarray, ...]:
    """The routing inputs as the kernels take them: float32 activations and weights, int64 ids, on the host."""
    return (
        x.detach().to("cpu", torch.float32).contiguous().numpy(),
        ids.detach().to("cpu", torch.int64).contiguous().numpy(),
        weights.detach().to("cpu", torch.float32).contiguous().numpy(),
    )
