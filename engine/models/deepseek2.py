"""DeepSeek-V2/V3/R1, Kimi-K2, GLM-4.7-Flash (deepseek2): MoE with multi-head latent attention.

Its quirks, all read from the file:
- Multi-head latent attention (MLA). A token's keys and values come from one compressed latent
  (`kv_lora_rank` numbers, RMS-normed) and one rotary key part shared by all heads. The cache
  holds only those (`kv_lora_rank + rope_dim` per position, the value being the latent's front),
  and each head's key and value projections are folded into its query and output: the score of
  head h is (q_nope_h W_kb_h) . latent + q_rope_h . k_rope, its output W_vb_h (probs @ latents).
  Both are exactly the expanded attention, reassociated.
- The query through a low-rank pair with a norm between (`attn_q_a`, `attn_q_a_norm`,
  `attn_q_b`), or one matrix (`attn_q`, the "lite" sizes).
- `attn_k_b` / `attn_v_b` per head, or in older files the joint `attn_kv_b`, split at load.
- Rotary embedding on adjacent pairs; with YaRN its magnitude goes into the score scale:
  (1 + yarn_log_multiplier * ln factor)^2 / sqrt(head_dim_mla).
- Leading dense layers, shared experts, routing by softmax or sigmoid with the correction bias and
  group-limited top-k, routed scaling: the shared decoder's MoE layer reads them from the file.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..gguf.reader import GGUFError
from ..gguf.sources import Layout, Source
from ..nn.activations import swiglu
from ..nn.layers import LayerCache, Rope, attention, rms_norm
from ..nn.qlinear import linear
from ..nn.weights import linear_form, maybe, want
from .decoder import Family


def score_scale(cfg: ModelConfig) -> float:
    """The factor on q . k: 1/sqrt(head length), times YaRN's magnitude squared where the file gives it."""
    s = cfg.rope_scaling
    m = 1 + s.yarn_log_mul * math.log(s.factor) if s.kind == "yarn" and s.factor > 1 else 1.0
    return m * m / math.sqrt(cfg.head_dim_mla)


class LatentAttention(nn.Module):
    def __init__(self, layout: Layout, cfg: ModelConfig, i: int, quantized: bool = False) -> None:
        super().__init__()
        p, form = f"blk.{i}.", linear_form(quantized)
        if not cfg.kv_lora_rank:
            raise GGUFError(f"{layout.path}: key {cfg.arch}.attention.kv_lora_rank: required for latent attention")
        self.cfg = cfg
        self.nope = cfg.head_dim_mla - cfg.rope_dim
        self.q_a = self.q_a_norm = self.q_b = self.q = None
        if p + "attn_q_a.weight" in layout.tensors:
            self.q_a = want(layout, p + "attn_q_a.weight", form)  # [q_lora, E]
            self.q_a_norm = want(layout, p + "attn_q_a_norm.weight")
            self.q_b = want(layout, p + "attn_q_b.weight", form)  # [H*Dk, q_lora]
        else:
            self.q = want(layout, p + "attn_q.weight", form)  # [H*Dk, E]
        self.kv_a = want(layout, p + "attn_kv_a_mqa.weight", form)  # [C + R, E]
        self.kv_a_norm = want(layout, p + "attn_kv_a_norm.weight")  # [C]
        # Per head, or (older files) the joint kv_b that on_load splits.
        self.kv_b = maybe(layout, p + "attn_kv_b.weight")
        self.k_b: Any = want(layout, p + "attn_k_b.weight") if self.kv_b is None else None
        self.v_b: Any = want(layout, p + "attn_v_b.weight") if self.kv_b is None else None
        self.wo = want(layout, p + "attn_output.weight", form)  # [E, H*Dv]
        self.scale = score_scale(self.cfg)

    def on_load(self, source: Source) -> None:
        h, c, dv = self.cfg.n_head, self.cfg.kv_lora_rank, self.cfg.head_dim_v_mla
        if self.kv_b is not None:
            kv_b = self.kv_b.reshape(h, self.nope + dv, c)
            self.k_b = kv_b[:, : self.nope].transpose(1, 2).contiguous()
            self.v_b = kv_b[:, self.nope :].contiguous()
            self.kv_b = None
        else:
            self.k_b = self.k_b.reshape(h, c, self.nope)  # [H, C, Dnope]
            self.v_b = self.v_b.reshape(h, dv, c)  # [H, Dv, C]

    def forward(self, h: torch.Tensor, pos0: int, cache: LayerCache, rope: Rope) -> torch.Tensor:
        cfg, t = self.cfg, h.shape[0]
        c, r = cfg.kv_lora_rank, cfg.rope_dim
        if self.q is not None:
            q = linear(h, self.q)
        else:
            assert self.q_a is not None and self.q_b is not None  # set together in __init__
            q = linear(rms_norm(linear(h, self.q_a), self.q_a_norm, cfg.norm_eps), self.q_b)
        q = q.view(t, cfg.n_head, cfg.head_dim_mla)  # [T, H, Dnope + R]
        kv = linear(h, self.kv_a)  # [T, C + R]
        latent = rms_norm(kv[:, :c].contiguous(), self.kv_a_norm, cfg.norm_eps).view(t, 1, c)  # [T, 1, C]
        pos = torch.arange(pos0, pos0 + t, device=h.device)
        q_rope = rope(q[..., self.nope :], pos)  # [T, H, R]
        k_rope = rope(kv[:, c:].reshape(t, 1, r), pos)  # [T, 1, R]
        q_lat = torch.einsum("thn,hcn->thc", q[..., : self.nope], self.k_b)  # [T, H, C]
        keys = torch.cat([latent, k_rope], dim=-1)  # [T, 1, C + R]
        a = attention(torch.cat([q_lat, q_rope], dim=-1), cache, keys, latent, pos0, scale=self.scale)  # [T, H, C]
        out = torch.einsum("thc,hvc->thv", a, self.v_b)  # [T, H, Dv]
        return linear(out.reshape(t, -1), self.wo)


FAMILY = Family(neox_rope=False, act=swiglu, attention=LatentAttention)
