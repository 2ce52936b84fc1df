"""gpt-oss: attention sinks, alternating sliding window, YaRN, biased experts, clamped "oai" SwiGLU.

Its files leave implicit that every other layer slides (the first one does) and that the router's
softmax runs over the selected experts only.

YaRN here is not truncated: transformers and OpenAI's reference keep the correction range
fractional, where ggml floors/ceils it (docs/design.md).
"""

import torch

from ..kernels.codes import ACT_OAI, GATING_SOFTMAX_SELECTED, SWIGLU_ALPHA, SWIGLU_LIMIT
from ..nn.activations import register_activation
from .decoder import Family


def oai_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


register_activation(oai_swiglu, ACT_OAI)


# Its files call the pre-FFN norm `post_attention_norm`.
FAMILY = Family(
    neox_rope=True, act=oai_swiglu, yarn_truncate=False, ffn_norm="post_attention_norm",
    metadata={"expert_gating_func": GATING_SOFTMAX_SELECTED, "attention.sliding_window_pattern": 2},
)  # fmt: skip
