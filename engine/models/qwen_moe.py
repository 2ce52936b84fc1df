"""Qwen MoE family: qwen3moe (QK-norm, normalised top-k) and qwen2moe (shared expert with a sigmoid gate)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..gguf_file import GGUFFile
from ..layers import KVCache, Rope, attention, load_weight, maybe_weight, rms_norm
from ..moe import ExpertExecutor, HostExperts, load_layer_experts, route, swiglu


class Block(nn.Module):
    def __init__(self, gguf: GGUFFile, cfg: ModelConfig, i: int) -> None:
        super().__init__()
        p = f"blk.{i}."
        self.i, self.cfg = i, cfg
        self.attn_norm = load_weight(gguf, p + "attn_norm.weight")
        self.wq = load_weight(gguf, p + "attn_q.weight")  # [H*D, E]
        self.wk = load_weight(gguf, p + "attn_k.weight")  # [Hkv*D, E]
        self.wv = load_weight(gguf, p + "attn_v.weight")
        self.wo = load_weight(gguf, p + "attn_output.weight")  # [E, H*D]
        self.bq, self.bk, self.bv = (maybe_weight(gguf, p + f"attn_{n}.bias") for n in "qkv")
        self.q_norm = maybe_weight(gguf, p + "attn_q_norm.weight")
        self.k_norm = maybe_weight(gguf, p + "attn_k_norm.weight")
        self.ffn_norm = load_weight(gguf, p + "ffn_norm.weight")
        self.router = load_weight(gguf, p + "ffn_gate_inp.weight")  # [n_expert, E]
        self.sh_gate = maybe_weight(gguf, p + "ffn_gate_shexp.weight")
        self.sh_up = maybe_weight(gguf, p + "ffn_up_shexp.weight")
        self.sh_down = maybe_weight(gguf, p + "ffn_down_shexp.weight")
        self.sh_gate_inp = maybe_weight(gguf, p + "ffn_gate_inp_shexp.weight")  # [E] or [1, E]

    def forward(self, x: torch.Tensor, pos0: int, cache: KVCache, rope: Rope, experts: ExpertExecutor) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        h = rms_norm(x, self.attn_norm, cfg.norm_eps)
        q = nn.functional.linear(h, self.wq, self.bq).view(t, cfg.n_head, cfg.head_dim)
        k = nn.functional.linear(h, self.wk, self.bk).view(t, cfg.n_head_kv[self.i], cfg.head_dim)
        v = nn.functional.linear(h, self.wv, self.bv).view(t, cfg.n_head_kv[self.i], cfg.head_dim_v)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.norm_eps)
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, cfg.norm_eps)
        pos = torch.arange(pos0, pos0 + t)
        q, k = rope(q, pos), rope(k, pos)
        a = attention(q, cache.layers[self.i], k, v, pos0, scale=cfg.head_dim**-0.5)  # [T, H, Dv]
        x = x + nn.functional.linear(a.reshape(t, -1), self.wo)

        h = rms_norm(x, self.ffn_norm, cfg.norm_eps)
        ids, weights = route(nn.functional.linear(h, self.router), cfg)  # [T, k] each
        y = experts(self.i, h, ids, weights)
        if self.sh_up is not None and self.sh_gate is not None and self.sh_down is not None:
            shared = nn.functional.linear(swiglu(h @ self.sh_gate.T, h @ self.sh_up.T), self.sh_down)
            if self.sh_gate_inp is not None:
                shared = shared * torch.sigmoid(h @ self.sh_gate_inp.reshape(-1, 1))
            y = y + shared
        return x + y


class QwenMoe(nn.Module):
    neox_rope = True

    def __init__(self, gguf: GGUFFile, cfg: ModelConfig, n_ctx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = load_weight(gguf, "token_embd.weight")  # [V, E]
        self.norm = load_weight(gguf, "output_norm.weight")
        out = maybe_weight(gguf, "output.weight")
        self.output = out if out is not None else self.embed  # tied embeddings
        self.blocks = nn.ModuleList(Block(gguf, cfg, i) for i in range(cfg.n_layers))
        self.rope = Rope(cfg.rope_dim, cfg.rope_theta, n_ctx, neox=self.neox_rope, cfg=cfg)
        self.host_experts = HostExperts({i: load_layer_experts(gguf, i) for i in range(cfg.n_layers)}, swiglu)
        self.experts: ExpertExecutor = self.host_experts

    def forward(self, tokens: torch.Tensor, pos0: int, cache: KVCache) -> torch.Tensor:
        """tokens [T] at positions pos0.. -> logits [T, V]; appends to `cache`."""
        x = self.embed[tokens]  # [T, E]
        for block in self.blocks:
            x = block(x, pos0, cache, self.rope, self.experts)
        cache.pos = pos0 + tokens.shape[0]
        return nn.functional.linear(rms_norm(x, self.norm, self.cfg.norm_eps), self.output)
