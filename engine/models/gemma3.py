"""Gemma 3: dense (`gemma3`) and the demo's MoE variant (`gemma3moe`).

Gemma specifics: embeddings scaled by sqrt(n_embd); norms before and after both the attention
and the FFN ("sandwich"); GELU (tanh) gating; per-head QK norms; five sliding-window layers
(rotary base 10k) for each global one (the file's base). GGUF stores the norms with Gemma's +1
already added. The MoE variant (engine/demo.py) splits each FFN's neurons into a shared expert,
always on, and routed experts chosen by a linear router; the selected experts' outputs are summed
unweighted (GATING_SELECT), so the experts' neurons add up exactly as in the dense FFN.
Its files leave implicit which layers slide and their rotary base: the family gives both.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from ..config import ModelConfig
from ..gguf.sources import Layout
from ..kernels.codes import ACT_GELU_TANH, GATING_SELECT
from ..nn.activations import register_activation
from ..nn.layers import Rope, move_tensors
from .decoder import Block, DecoderBase, Family


def gelu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


register_activation(gelu_gate, ACT_GELU_TANH)


class Gemma3(DecoderBase):
    def __init__(
        self, layout: Layout, cfg: ModelConfig, n_ctx: int, *, quantized: bool = False, kernels: str = "fast",
        dequant_mib: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.cfg = cfg
        self._build_ends(layout, quantized)
        self.embed_scale = math.sqrt(cfg.n_embd)
        self.blocks = nn.ModuleList(Block(layout, cfg, i, FAMILY, quantized) for i in range(cfg.n_layers))
        rope_global = Rope(cfg.rope_dim, cfg.rope_theta, n_ctx, neox=True, cfg=cfg)
        rope_local = Rope(cfg.rope_dim, cfg.rope_theta_swa or cfg.rope_theta, n_ctx, neox=True)
        self.rope = (rope_global, rope_local)
        self._build_experts(layout, gelu_gate, kernels, dequant_mib)

    def to_device(self, device: torch.device) -> Gemma3:
        """Move everything but the experts (they stay in host memory) to `device`."""
        move_tensors(self, device)
        for r in self.rope:
            r.to(device)
        self.drop_plans()
        return self

    def layer_rope(self, i: int) -> Rope:
        """Sliding-window layers rotate with the local base, the others with the file's."""
        return self.rope[1] if self.cfg.swa_layers and self.cfg.swa_layers[i] else self.rope[0]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens.to(self.embed.device)] * self.embed_scale  # [T, E]


FAMILY = Family(
    neox_rope=True, act=gelu_gate, decoder=Gemma3, post_norms=True,
    metadata={"attention.sliding_window_pattern": 6, "rope.freq_base_swa": 10_000.0},  # five local per global
)  # fmt: skip
FAMILY_MOE = replace(FAMILY, metadata={**FAMILY.metadata, "expert_gating_func": GATING_SELECT})
