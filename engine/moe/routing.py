"""Router logits to the experts each token uses and their weights, per the family's rule."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.codes import GATING_SELECT, GATING_SIGMOID, GATING_SOFTMAX_SELECTED
from ..kernels.layer_halves import FEW_ROWS, route_rows
from ..nn.eager import compiled_ok
from ..nn.layers import host_rows


def select(
    h: torch.Tensor, router: torch.Tensor, router_bias: torch.Tensor | None, cfg: ModelConfig,
    choice_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Normalised hidden states [T, E] -> the experts they route to (ids [T, k], weights [T, k]): the router's
    logits, then `route`. A few float32 rows on the CPU take the compiled rule (`route_rows`, the same rule, each
    row routed on its own: the same bits alone and among others)."""
    if h.shape[0] <= FEW_ROWS and h.device.type == "cpu" and h.dtype == torch.float32 and compiled_ok():
        bias = None if router_bias is None else router_bias.numpy()
        i, w = route_rows(host_rows(h), router.numpy(), bias, cfg.expert_gating, cfg.n_expert_used,
                          cfg.expert_weights_norm, cfg.expert_weights_scale,
                          None if choice_bias is None else choice_bias.numpy(), cfg.expert_groups,
                          cfg.expert_groups_used)  # fmt: skip
        return torch.from_numpy(i), torch.from_numpy(w)
    return route(F.linear(h, router, router_bias), cfg, choice_bias)


def route(
    logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (ids [T, k], weights [T, k]) per the family's normalisation."""
    k = cfg.n_expert_used
    if cfg.expert_gating == GATING_SELECT:
        ids = torch.topk(logits, k, dim=-1).indices  # [T, k]
        return ids, torch.ones(ids.shape, dtype=logits.dtype, device=logits.device)
    if cfg.expert_gating == GATING_SIGMOID:
        probs = torch.sigmoid(logits)
    elif cfg.expert_gating == GATING_SOFTMAX_SELECTED:
        probs = logits
    else:
        probs = F.softmax(logits, dim=-1)
    scores = probs + bias if bias is not None else probs  # the bias steers the choice, not the weights
    if cfg.expert_groups > 1:
        # Only the best groups compete: a group's score is the sum of its two best experts.
        n_tok, n_exp = scores.shape
        grouped = scores.view(n_tok, cfg.expert_groups, n_exp // cfg.expert_groups)  # [T, G, E/G]
        best = torch.topk(grouped.topk(2, dim=-1).values.sum(-1), cfg.expert_groups_used, dim=-1).indices  # [T, g]
        keep = torch.zeros(n_tok, cfg.expert_groups, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, best, True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n_tok, n_exp)
    ids = torch.topk(scores, k, dim=-1).indices  # [T, k]
    weights = probs.gather(-1, ids)
    if cfg.expert_gating == GATING_SOFTMAX_SELECTED:
        weights = F.softmax(weights, dim=-1)
    elif cfg.expert_weights_norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * cfg.expert_weights_scale
