"""Router logits to the experts each token uses and their weights, per the family's rule.

The rule has one definition, in compiled code (`kernels.layer_halves.select_compiled`), which a decode
token's one-call MoE layer also runs: a prompt's routing and a token's choose alike, ties included.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import ModelConfig
from ..kernels.layer_halves import select_compiled

_NONE = np.zeros(0, np.float32)


def route(
    logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (ids [T, k], weights [T, k]) per the family's rule; `bias` steers the choice,
    not the weights. On the logits' device, the weights in their dtype."""
    rows = np.ascontiguousarray(logits.detach().to("cpu", torch.float32).numpy())  # [T, E]
    choice = _NONE if bias is None else bias.detach().to("cpu", torch.float32).numpy()
    ids, weights = select_compiled(rows, cfg.expert_gating, cfg.n_expert_used, cfg.expert_weights_norm,
                                   np.float32(cfg.expert_weights_scale), choice, cfg.expert_groups,
                                   cfg.expert_groups_used)  # fmt: skip
    return torch.from_numpy(ids).to(logits.device), torch.from_numpy(weights).to(logits.device, logits.dtype)
