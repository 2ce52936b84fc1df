"""Reference models in transformers holding the same weights as our GGUF test models (fp32)."""

from __future__ import annotations

from typing import Any

import torch
from moechat.engine.config import ModelConfig
from moechat.engine.gguf.reader import GGUFFile
from moechat.engine.nn.layers import load_weight


def maybe_weight(source: Any, name: str) -> torch.Tensor | None:
    return load_weight(source, name) if name in source.tensors else None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo the q/k row permutation llama.cpp's converter applies for adjacent-pair rotary embeddings."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(cfg: ModelConfig, dense_lead: int = 0, qk_norm: bool = False) -> Any:
    import transformers as tf

    common: dict[str, Any] = {
        "vocab_size": cfg.n_vocab, "hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head_kv[0], "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.n_ctx_train, "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": False,
        "num_experts_per_tok": cfg.n_expert_used, "rope_theta": cfg.rope_theta,
    }  # fmt: skip
    if cfg.arch == "qwen3moe":
        return tf.Qwen3MoeConfig(**common, num_experts=cfg.n_expert, moe_intermediate_size=cfg.n_ff_exp,
                                 intermediate_size=cfg.n_ff_exp, norm_topk_prob=True, decoder_sparse_step=1,
                                 mlp_only_layers=[])  # fmt: skip
    if cfg.arch == "qwen2moe":
        return tf.Qwen2MoeConfig(**common, num_experts=cfg.n_expert, moe_intermediate_size=cfg.n_ff_exp,
                                 intermediate_size=cfg.n_ff_exp, shared_expert_intermediate_size=cfg.n_ff_shexp,
                                 norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    if not cfg.is_moe:
        dense = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config}[cfg.arch]
        return dense(**common, intermediate_size=cfg.n_ff)
    if cfg.arch == "llama":
        return tf.MixtralConfig(**common, num_local_experts=cfg.n_expert, intermediate_size=cfg.n_ff_exp)
    if cfg.arch == "olmoe":
        return tf.OlmoeConfig(**common, num_experts=cfg.n_expert, intermediate_size=cfg.n_ff_exp, norm_topk_prob=False)
    if cfg.arch == "gpt-oss":
        s = cfg.rope_scaling
        del common["rope_theta"]
        rope = {
            "rope_type": "yarn", "factor": s.factor, "beta_fast": s.yarn_beta_fast, "beta_slow": s.yarn_beta_slow,
            "truncate": False, "original_max_position_embeddings": s.original_context, "rope_theta": cfg.rope_theta,
        }  # fmt: skip
        kinds = ["sliding_attention" if swa else "full_attention" for swa in cfg.swa_layers]
        return tf.GptOssConfig(**common, num_local_experts=cfg.n_expert, intermediate_size=cfg.n_ff_exp,
                               sliding_window=cfg.sliding_window, rope_parameters=rope, layer_types=kinds)  # fmt: skip
    if cfg.arch == "glm4moe":
        partial: dict[str, Any] = {"partial_rotary_factor": cfg.rope_dim / cfg.head_dim}  # an init-only argument
        return tf.Glm4MoeConfig(**common, **partial, n_routed_experts=cfg.n_expert, moe_intermediate_size=cfg.n_ff_exp,
                                intermediate_size=cfg.n_ff, n_shared_experts=cfg.n_expert_shared,
                                routed_scaling_factor=cfg.expert_weights_scale, n_group=cfg.expert_groups,
                                topk_group=cfg.expert_groups_used, first_k_dense_replace=dense_lead,
                                norm_topk_prob=cfg.expert_weights_norm, use_qk_norm=qk_norm, attention_bias=True,
                                num_mtp_layers=0)  # fmt: skip
    if cfg.arch == "deepseek2":
        s = cfg.rope_scaling
        del common["rope_theta"]
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if s.kind == "yarn":
            mscale = s.yarn_log_mul / 0.1  # the file holds 0.1 x mscale_all_dim
            rope = {
                "rope_type": "yarn", "factor": s.factor, "beta_fast": s.yarn_beta_fast, "beta_slow": s.yarn_beta_slow,
                "original_max_position_embeddings": s.original_context, "rope_theta": cfg.rope_theta,
                "mscale": mscale, "mscale_all_dim": mscale,
            }  # fmt: skip
        common["num_key_value_heads"] = cfg.n_head
        del common["head_dim"]
        return tf.DeepseekV3Config(**common, n_routed_experts=cfg.n_expert, moe_intermediate_size=cfg.n_ff_exp,
                                   intermediate_size=cfg.n_ff, n_shared_experts=cfg.n_expert_shared,
                                   routed_scaling_factor=cfg.expert_weights_scale, n_group=cfg.expert_groups,
                                   topk_group=cfg.expert_groups_used, first_k_dense_replace=dense_lead,
                                   norm_topk_prob=cfg.expert_weights_norm, kv_lora_rank=cfg.kv_lora_rank,
                                   q_lora_rank=cfg.q_lora_rank or None, qk_rope_head_dim=cfg.rope_dim,
                                   qk_nope_head_dim=cfg.head_dim_mla - cfg.rope_dim, v_head_dim=cfg.head_dim_v_mla,
                                   rope_parameters=rope, rope_interleave=True, num_mtp_layers=0)  # fmt: skip
    if cfg.arch in ("qwen3next", "qwen35moe"):
        del common["rope_theta"]
        partial = cfg.rope_dim / cfg.head_dim
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": partial}
        kinds = ["linear_attention" if cfg.is_recurrent(i) else "full_attention" for i in range(cfg.n_layers)]
        hybrid = dict(
            num_experts=cfg.n_expert, moe_intermediate_size=cfg.n_ff_exp,
            shared_expert_intermediate_size=cfg.n_ff_shexp,
            linear_conv_kernel_dim=cfg.ssm_conv_kernel, linear_key_head_dim=cfg.ssm_state,
            linear_value_head_dim=cfg.ssm_inner // cfg.ssm_v_heads, linear_num_key_heads=cfg.ssm_k_heads,
            linear_num_value_heads=cfg.ssm_v_heads, layer_types=kinds, rope_parameters=rope,
        )  # fmt: skip
        if cfg.arch == "qwen3next":
            return tf.Qwen3NextConfig(**common, **hybrid, intermediate_size=cfg.n_ff_exp, norm_topk_prob=True,
                                      decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
        return tf.Qwen3_5MoeTextConfig(**common, **hybrid)
    raise ValueError(cfg.arch)


def _untile(w: torch.Tensor, cfg: ModelConfig, head: int, dim: int = 0) -> torch.Tensor:
    """Qwen3.5's converter orders value heads tiled over the key heads; transformers groups them."""
    hk, r = cfg.ssm_k_heads, cfg.ssm_v_heads // cfg.ssm_k_heads
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], r, hk, head, *shape[dim + 1 :]).transpose(dim, dim + 1)
    return w.reshape(shape)


def _delta_net(sd: dict[str, torch.Tensor], hf: str, b: str, cfg: ModelConfig, gguf: GGUFFile) -> None:
    """A Gated DeltaNet layer under transformers' names and orders (Qwen3-Next: q|k|v|z and b|a per key head)."""
    hk, hv, dk = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state
    dv, r = cfg.ssm_inner // hv, hv // hk
    p = hf + "linear_attn."
    if b + "ssm_in.weight" in gguf.tensors:  # the first converters' layout is transformers' own
        sd[p + "in_proj_qkvz.weight"] = load_weight(gguf, b + "ssm_in.weight")
        sd[p + "in_proj_ba.weight"] = load_weight(gguf, b + "ssm_ba.weight")
    else:
        qkv, z = load_weight(gguf, b + "attn_qkv.weight"), load_weight(gguf, b + "attn_gate.weight")
    conv = load_weight(gguf, b + "ssm_conv1d.weight")
    dt, a_log = load_weight(gguf, b + "ssm_dt.bias"), torch.log(-load_weight(gguf, b + "ssm_a"))
    out = load_weight(gguf, b + "ssm_out.weight")
    if cfg.arch == "qwen3next" and b + "ssm_in.weight" not in gguf.tensors:
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv])
        per_head = [q.view(hk, dk, -1), k.view(hk, dk, -1), v.view(hk, r * dv, -1), z.view(hk, r * dv, -1)]
        sd[p + "in_proj_qkvz.weight"] = torch.cat(per_head, dim=1).reshape(-1, cfg.n_embd)
        sd[p + "in_proj_ba.weight"] = load_weight(gguf, b + "ssm_ba.weight")
    elif cfg.arch == "qwen35moe":
        qk = qkv[: 2 * hk * dk]
        sd[p + "in_proj_qkv.weight"] = torch.cat([qk, _untile(qkv[2 * hk * dk :], cfg, dv)])
        sd[p + "in_proj_z.weight"] = _untile(z, cfg, dv)
        sd[p + "in_proj_b.weight"] = _untile(load_weight(gguf, b + "ssm_beta.weight"), cfg, 1)
        sd[p + "in_proj_a.weight"] = _untile(load_weight(gguf, b + "ssm_alpha.weight"), cfg, 1)
        conv = torch.cat([conv[: 2 * hk * dk], _untile(conv[2 * hk * dk :], cfg, dv)])
        dt, a_log = _untile(dt, cfg, 1), _untile(a_log, cfg, 1)
        out = _untile(out, cfg, dv, dim=1)
    sd[p + "conv1d.weight"] = conv[:, None, :]
    sd[p + "dt_bias"], sd[p + "A_log"] = dt, a_log
    sd[p + "norm.weight"] = load_weight(gguf, b + "ssm_norm.weight")  # the gated norm: weights as they are
    sd[p + "out_proj.weight"] = out


def _mla_attention(sd: dict[str, torch.Tensor], hf: str, b: str, cfg: ModelConfig, gguf: GGUFFile) -> None:
    """DeepSeek's attention weights under transformers' names; k_b/v_b joined back into kv_b_proj."""
    names = {
        "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
        "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output",
    }  # fmt: skip
    for theirs, ours in names.items():
        sd[f"{hf}self_attn.{theirs}.weight"] = load_weight(gguf, f"{b}{ours}.weight")
    h, c, nope = cfg.n_head, cfg.kv_lora_rank, cfg.head_dim_mla - cfg.rope_dim
    k_b = load_weight(gguf, b + "attn_k_b.weight").reshape(h, c, nope).transpose(1, 2)  # [H, Dnope, C]
    v_b = load_weight(gguf, b + "attn_v_b.weight").reshape(h, -1, c)  # [H, Dv, C]
    sd[hf + "self_attn.kv_b_proj.weight"] = torch.cat([k_b, v_b], dim=1).reshape(-1, c)


def hf_reference(gguf: GGUFFile, cfg: ModelConfig) -> Any:
    import transformers as tf

    classes = {
        "qwen3moe": "Qwen3Moe",
        "qwen2moe": "Qwen2Moe",
        "llama": "Mixtral",
        "olmoe": "Olmoe",
        "gpt-oss": "GptOss",
        "glm4moe": "Glm4Moe",
        "deepseek2": "DeepseekV3",
        "qwen3next": "Qwen3Next",
        "qwen35moe": "Qwen3_5Moe",
    }
    name = classes[cfg.arch] if cfg.is_moe else {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[cfg.arch]
    dense_lead = sum(f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors for i in range(cfg.n_layers))
    qk_norm = "blk.0.attn_q_norm.weight" in gguf.tensors
    model = getattr(tf, name + "ForCausalLM")(_hf_config(cfg, dense_lead, qk_norm)).eval()

    def w(name: str) -> torch.Tensor:
        return load_weight(gguf, name)

    sd = {
        "model.embed_tokens.weight": w("token_embd.weight"),
        "lm_head.weight": w("output.weight"),
        "model.norm.weight": w("output_norm.weight"),
    }
    hybrid = cfg.arch in ("qwen3next", "qwen35moe")
    for i in range(cfg.n_layers):
        hf, b = f"model.layers.{i}.", f"blk.{i}."
        sd[hf + "input_layernorm.weight"] = w(b + "attn_norm.weight")
        ffn_norm = "post_attention_norm" if cfg.arch in ("gpt-oss", "glm4moe") or hybrid else "ffn_norm"
        sd[hf + "post_attention_layernorm.weight"] = w(f"{b}{ffn_norm}.weight")
        attn = () if cfg.kv_lora_rank else (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"))
        if cfg.kv_lora_rank:
            _mla_attention(sd, hf, b, cfg, gguf)
        if cfg.is_recurrent(i):
            _delta_net(sd, hf, b, cfg, gguf)
            attn = ()
        for proj, ours in (*attn, *(() if cfg.is_recurrent(i) else (("o_proj", "attn_output"),))):
            sd[f"{hf}self_attn.{proj}.weight"] = w(f"{b}{ours}.weight")
            bias = maybe_weight(gguf, f"{b}{ours}.bias")
            if bias is not None:
                sd[f"{hf}self_attn.{proj}.bias"] = bias
        if cfg.arch == "llama":
            sd[hf + "self_attn.q_proj.weight"] = _unpermute(sd[hf + "self_attn.q_proj.weight"], cfg.n_head)
            sd[hf + "self_attn.k_proj.weight"] = _unpermute(sd[hf + "self_attn.k_proj.weight"], cfg.n_head_kv[i])
        for n in ("q", "k"):
            norm = maybe_weight(gguf, f"{b}attn_{n}_norm.weight")
            if norm is not None:
                sd[f"{hf}self_attn.{n}_norm.weight"] = norm
        if f"{b}ffn_gate.weight" in gguf.tensors:  # a dense FFN
            for proj in ("gate", "up", "down"):
                sd[f"{hf}mlp.{proj}_proj.weight"] = w(f"{b}ffn_{proj}.weight")
            continue
        gate, up, down = (w(f"{b}ffn_{k}_exps.weight") for k in ("gate", "up", "down"))  # [n_expert, rows, cols]
        if cfg.arch == "gpt-oss":
            sd[hf + "self_attn.sinks"] = w(b + "attn_sinks.weight")
            sd[hf + "mlp.router.weight"] = w(b + "ffn_gate_inp.weight")
            sd[hf + "mlp.router.bias"] = w(b + "ffn_gate_inp.bias")
            # transformers interleaves gate and up columns and multiplies x @ W.
            sd[hf + "mlp.experts.gate_up_proj"] = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2)
            gb, ub = w(b + "ffn_gate_exps.bias"), w(b + "ffn_up_exps.bias")
            sd[hf + "mlp.experts.gate_up_proj_bias"] = torch.stack([gb, ub], dim=2).flatten(1, 2)
            sd[hf + "mlp.experts.down_proj"] = down.transpose(1, 2)
            sd[hf + "mlp.experts.down_proj_bias"] = w(b + "ffn_down_exps.bias")
            continue
        sd[hf + "mlp.gate.weight"] = w(b + "ffn_gate_inp.weight")
        sd[hf + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [n_expert, 2F, E]
        sd[hf + "mlp.experts.down_proj"] = down
        if cfg.arch in ("glm4moe", "deepseek2"):
            sd[hf + "mlp.gate.e_score_correction_bias"] = w(b + "exp_probs_b.bias")
            for proj in ("gate", "up", "down"):
                sd[f"{hf}mlp.shared_experts.{proj}_proj.weight"] = w(f"{b}ffn_{proj}_shexp.weight")
        if cfg.arch in ("qwen2moe", "qwen3next", "qwen35moe"):
            sd[hf + "mlp.shared_expert.gate_proj.weight"] = w(b + "ffn_gate_shexp.weight")
            sd[hf + "mlp.shared_expert.up_proj.weight"] = w(b + "ffn_up_shexp.weight")
            sd[hf + "mlp.shared_expert.down_proj.weight"] = w(b + "ffn_down_shexp.weight")
            sd[hf + "mlp.shared_expert_gate.weight"] = w(b + "ffn_gate_inp_shexp.weight").reshape(1, -1)
    if hybrid:  # transformers' zero-centred norms: the converter added the 1 that the file holds
        for name in sd:
            if name.endswith("norm.weight") and "linear_attn" not in name:
                sd[name] = sd[name] - 1
    model.load_state_dict(sd, strict=True)
    return model
