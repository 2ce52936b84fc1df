"""Reference models in transformers with the same weights as our GGUF test models."""

from __future__ import annotations

from typing import Any

import torch
from moechat.engine.config import ModelConfig
from moechat.engine.gguf_file import GGUFFile
from moechat.engine.layers import load_weight


def qwen3moe_reference(gguf: GGUFFile, cfg: ModelConfig) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # Passed through **kwargs: transformers accepts them, its type hints do not list them.
    loose: dict[str, Any] = {"head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta}
    hf_cfg = Qwen3MoeConfig(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff_exp,
        moe_intermediate_size=cfg.n_ff_exp, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head_kv[0], num_experts=cfg.n_expert,
        num_experts_per_tok=cfg.n_expert_used, norm_topk_prob=cfg.expert_weights_norm,
        max_position_embeddings=cfg.n_ctx_train, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], **loose,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(hf_cfg).eval()

    def w(name: str) -> torch.Tensor:
        return load_weight(gguf, name)

    sd = {
        "model.embed_tokens.weight": w("token_embd.weight"),
        "lm_head.weight": w("output.weight"),
        "model.norm.weight": w("output_norm.weight"),
    }
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate": "ffn_gate_inp", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"blk.{i}."
        for a, b in names.items():
            sd[f"{hf}{a}.weight"] = w(f"{ours}{b}.weight")
        gate, up, down = (w(f"{ours}ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
        sd[hf + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [n_expert, 2*F, E]
        sd[hf + "mlp.experts.down_proj"] = down
    model.load_state_dict(sd, strict=True)
    return model
