"""`ModelConfig`: the hyperparameters of a model, read from its GGUF metadata.

Everything comes from `{arch}.*` keys (and, where the format has no key, from which tensors
exist): never from a table of model names. What a family's files leave implicit, its module
under models/ gives as defaults for those keys (`Family.metadata`).
"""

from __future__ import annotations

import numbers
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .gguf.reader import GGUFError
from .kernels.codes import GATING_SOFTMAX

if TYPE_CHECKING:
    from .gguf.sources import ModelFile


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    original_context: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ext_factor: float = -1.0  # < 0: derived from the factor, as llama.cpp does
    yarn_attn_factor: float = 1.0
    yarn_log_mul: float = 0.0  # > 0: the attention scores carry YaRN's magnitude, not the rotation (MLA files)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    n_layers: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer
    head_dim: int  # key length
    head_dim_v: int  # value length
    n_ff: int  # dense FFN width (0 if none)
    norm_eps: float
    rope_theta: float
    rope_dim: int
    rope_scaling: RopeScaling
    # Mixture of experts (n_expert == 0: dense).
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_expert_shared: int = 0
    n_ff_shexp: int = 0
    expert_weights_norm: bool = False
    expert_weights_scale: float = 1.0
    expert_gating: int = GATING_SOFTMAX
    # Group-limited selection (DeepSeek-V3 style): experts fall in `expert_groups` equal groups,
    # and a token picks its experts from the `expert_groups_used` groups with the best top-2 sums.
    expert_groups: int = 1
    expert_groups_used: int = 1
    # Multi-head latent attention (kv_lora_rank > 0): the cache holds one latent of `kv_lora_rank`
    # plus the rotary key per position (head_dim = kv_lora_rank + rope_dim, head_dim_v = kv_lora_rank);
    # each head's query and key are head_dim_mla long, its value head_dim_v_mla.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    head_dim_mla: int = 0
    head_dim_v_mla: int = 0
    n_layers_skipped: int = 0  # trailing blocks the file carries but decoding skips (NextN/MTP layers)
    # Linear attention (Gated DeltaNet) in the layers marked `recurrent`: a short causal conv over
    # q|k|v (`ssm_conv_kernel` taps) and per value head a [ssm_state, head_v] state instead of a
    # KV cache; `ssm_k_heads` query/key heads serve `ssm_v_heads` value heads of ssm_inner / ssm_v_heads.
    recurrent: tuple[bool, ...] = ()  # per layer; () or all False: no linear attention
    ssm_conv_kernel: int = 0
    ssm_inner: int = 0
    ssm_state: int = 0
    ssm_v_heads: int = 0
    ssm_k_heads: int = 0
    # Attention details.
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()  # per layer: does it use the sliding window?
    rope_theta_swa: float = 0.0  # 0: same as rope_theta
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def is_recurrent(self, i: int) -> bool:
        return bool(self.recurrent) and self.recurrent[i]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_layers)) if self.is_moe else ()


def _get(meta: Mapping[str, Any], path: str, key: str, default: Any = None, *, required: bool = False) -> Any:
    value = meta.get(key, default)
    if value is None and required:
        raise GGUFError(f"{path}: key {key}: required for this architecture but missing")
    return value


def _int(meta: Mapping[str, Any], path: str, key: str, default: int | None = None) -> int:
    value = _get(meta, path, key, default, required=default is None)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GGUFError(f"{path}: key {key}: expected an integer, got {type(value).__name__}")
    value = int(value)
    if value < 0:
        raise GGUFError(f"{path}: key {key}: must not be negative, got {value}")
    return value


def _float(meta: Mapping[str, Any], path: str, key: str, default: float | None = None) -> float:
    value = _get(meta, path, key, default, required=default is None)
    if isinstance(value, (str, list, bool)):
        raise GGUFError(f"{path}: key {key}: expected a number, got {type(value).__name__}")
    return float(value)


def _per_layer(meta: Mapping[str, Any], path: str, key: str, n_layers: int, default: int) -> tuple[int, ...]:
    value = meta.get(key, default)
    if isinstance(value, (int,)) and not isinstance(value, bool):
        return (int(value),) * n_layers
    try:
        values = tuple(int(v) for v in value)
    except TypeError:
        raise GGUFError(f"{path}: key {key}: expected an integer or an array of integers") from None
    if len(values) != n_layers:
        raise GGUFError(f"{path}: key {key}: {len(values)} values for {n_layers} layers")
    return values


def _recurrent_layers(meta: Mapping[str, Any], path: str, p: str, n_blocks: int) -> tuple[bool, ...]:
    """Which blocks use linear attention: every one but each `full_attention_interval`-th, where
    the file describes a recurrent state (Qwen3-Next, Qwen3.5); none otherwise."""
    if p + "ssm.inner_size" not in meta:
        return (False,) * n_blocks
    interval = _int(meta, path, p + "full_attention_interval", 4)
    if interval == 0:
        raise GGUFError(f"{path}: key {p}full_attention_interval: must be positive")
    return tuple((i + 1) % interval != 0 for i in range(n_blocks))


def model_config(gguf: ModelFile, defaults: Mapping[str, Any] | None = None) -> ModelConfig:
    """Build the config of an opened file, or raise `GGUFError` naming the problem.

    `defaults`: values for `{arch}.` keys the file does not hold (its family's, `models.config_for`).
    """
    arch, path = gguf.architecture, str(gguf.path)
    p = f"{arch}."
    meta: Mapping[str, Any] = ChainMap(dict(gguf.metadata), {p + k: v for k, v in (defaults or {}).items()})
    n_blocks = _int(meta, path, p + "block_count")
    # Multi-token-prediction (NextN) layers trail the decoder's blocks; plain decoding never runs them.
    n_nextn = _int(meta, path, p + "nextn_predict_layers", 0)
    if n_nextn >= n_blocks > 0:
        raise GGUFError(f"{path}: key {p}nextn_predict_layers: {n_nextn} leaves none of the {n_blocks} blocks")
    n_layers = n_blocks - n_nextn
    n_embd = _int(meta, path, p + "embedding_length")
    n_head = _int(meta, path, p + "attention.head_count")
    if n_layers == 0 or n_embd == 0 or n_head == 0:
        raise GGUFError(f"{path}: block_count, embedding_length and head_count must be positive")
    recurrent = _recurrent_layers(meta, path, p, n_blocks)[:n_layers]
    n_head_kv = _per_layer(meta, path, p + "attention.head_count_kv", n_blocks, n_head)[:n_layers]
    if any(recurrent):  # linear-attention layers have no KV heads (some files say 0): full attention's count
        full = [h for h, r in zip(n_head_kv, recurrent, strict=True) if h and not r]
        n_head_kv = tuple((full[0] if full else n_head) if r else h for h, r in zip(n_head_kv, recurrent, strict=True))
    if any(h == 0 or n_head % h for h in n_head_kv):
        raise GGUFError(f"{path}: key {p}attention.head_count_kv: {n_head_kv} does not divide {n_head} heads")
    head_dim = _int(meta, path, p + "attention.key_length", n_embd // n_head)
    head_dim_v = _int(meta, path, p + "attention.value_length", head_dim)
    rope_dim = _int(meta, path, p + "rope.dimension_count", head_dim)
    kv_lora_rank = _int(meta, path, p + "attention.kv_lora_rank", 0)
    head_dim_mla = _int(meta, path, p + "attention.key_length_mla", head_dim)
    head_dim_v_mla = _int(meta, path, p + "attention.value_length_mla", head_dim_v)
    if kv_lora_rank:
        # Files from before the *_mla keys give the per-head lengths as key/value lengths; either
        # way the cache holds one latent head of kv_lora_rank + rope_dim (value: the latent).
        if not 0 < rope_dim < head_dim_mla:
            raise GGUFError(
                f"{path}: key {p}rope.dimension_count: {rope_dim} is not below the key length {head_dim_mla}"
            )
        head_dim, head_dim_v, n_head_kv = kv_lora_rank + rope_dim, kv_lora_rank, (1,) * n_layers
    tokens = meta.get("tokenizer.ggml.tokens")
    embd = gguf.tensors.get("token_embd.weight")
    n_vocab = int(embd.shape[0]) if embd is not None else len(tokens or [])
    n_vocab = _int(meta, path, p + "vocab_size", n_vocab)

    n_expert = _int(meta, path, p + "expert_count", 0)
    n_expert_used = _int(meta, path, p + "expert_used_count", 0)
    if n_expert and not 0 < n_expert_used <= n_expert:
        raise GGUFError(f"{path}: key {p}expert_used_count: {n_expert_used} not in 1..{n_expert}")
    n_groups = max(1, _int(meta, path, p + "expert_group_count", 1))
    n_groups_used = max(1, _int(meta, path, p + "expert_group_used_count", 1))
    if n_expert and (
        n_expert % n_groups or n_groups_used > n_groups or n_expert_used > n_expert // n_groups * n_groups_used
    ):
        raise GGUFError(f"{path}: key {p}expert_group_count: {n_groups} groups ({n_groups_used} used) do not fit "
                        f"{n_expert} experts with {n_expert_used} used per token")  # fmt: skip
    if n_expert and n_groups > 1 and n_expert // n_groups < 2:  # a group's score is the sum of its best two
        raise GGUFError(f"{path}: key {p}expert_group_count: groups of {n_expert // n_groups} expert; "
                        "group-limited routing needs at least 2 experts per group")  # fmt: skip
    ssm = {k: _int(meta, path, f"{p}ssm.{k}", 0) for k in ("conv_kernel", "inner_size", "state_size",
                                                            "time_step_rank", "group_count")}  # fmt: skip
    if any(recurrent):
        v_heads, k_heads = ssm["time_step_rank"], ssm["group_count"]
        if not (ssm["conv_kernel"] and ssm["state_size"] and k_heads and v_heads and v_heads % k_heads == 0
                and ssm["inner_size"] % v_heads == 0):  # fmt: skip
            raise GGUFError(f"{path}: keys {p}ssm.*: {ssm} do not describe linear attention (value heads a multiple "
                            "of the key heads, inner size a multiple of the value heads)")  # fmt: skip
    n_ff = meta.get(p + "feed_forward_length", 0)
    n_ff = max(n_ff) if isinstance(n_ff, (list, tuple)) or hasattr(n_ff, "shape") else int(n_ff)

    scaling_type = str(meta.get(p + "rope.scaling.type", "none"))
    rope_scaling = RopeScaling(
        kind=scaling_type,
        factor=_float(meta, path, p + "rope.scaling.factor", 1.0),
        original_context=_int(meta, path, p + "rope.scaling.original_context_length", 0),
        yarn_beta_fast=_float(meta, path, p + "rope.scaling.yarn_beta_fast", 32.0),
        yarn_beta_slow=_float(meta, path, p + "rope.scaling.yarn_beta_slow", 1.0),
        yarn_ext_factor=_float(meta, path, p + "rope.scaling.yarn_ext_factor", -1.0),
        yarn_attn_factor=_float(meta, path, p + "rope.scaling.yarn_attn_factor", 1.0),
        yarn_log_mul=_float(meta, path, p + "rope.scaling.yarn_log_multiplier", 0.0),
    )

    # Which layers slide: every `pattern`-th layer is global (an integer), or one flag per layer.
    sliding_window = _int(meta, path, p + "attention.sliding_window", 0)
    swa_layers: tuple[bool, ...] = (False,) * n_layers
    pattern = meta.get(p + "attention.sliding_window_pattern")
    if pattern is not None and sliding_window:
        if isinstance(pattern, (int,)) and not isinstance(pattern, bool):
            swa_layers = tuple(int(pattern) > 0 and (i + 1) % int(pattern) != 0 for i in range(n_layers))
        else:
            swa_layers = tuple(bool(v) for v in pattern)[:n_layers]
    gating = _int(meta, path, p + "expert_gating_func", GATING_SOFTMAX)

    default_eps = _float(meta, path, p + "attention.layer_norm_epsilon", 1e-5)
    return ModelConfig(
        arch=arch,
        name=str(meta.get("general.name", Path(gguf.path).stem)),
        n_layers=n_layers,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_ctx_train=_int(meta, path, p + "context_length", 4096),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_ff=n_ff,
        norm_eps=_float(meta, path, p + "attention.layer_norm_rms_epsilon", default_eps),
        rope_theta=_float(meta, path, p + "rope.freq_base", 10_000.0),
        rope_dim=rope_dim,
        rope_scaling=rope_scaling,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_exp=_int(meta, path, p + "expert_feed_forward_length", n_ff if n_expert else 0),
        n_expert_shared=_int(meta, path, p + "expert_shared_count", 0),
        n_ff_shexp=_int(meta, path, p + "expert_shared_feed_forward_length", 0),
        expert_weights_norm=bool(meta.get(p + "expert_weights_norm", False)),
        expert_weights_scale=_float(meta, path, p + "expert_weights_scale", 1.0),
        expert_gating=gating,
        expert_groups=n_groups,
        expert_groups_used=n_groups_used,
        q_lora_rank=_int(meta, path, p + "attention.q_lora_rank", 0),
        kv_lora_rank=kv_lora_rank,
        head_dim_mla=head_dim_mla,
        head_dim_v_mla=head_dim_v_mla,
        n_layers_skipped=n_nextn,
        recurrent=recurrent if any(recurrent) else (),
        ssm_conv_kernel=ssm["conv_kernel"],
        ssm_inner=ssm["inner_size"],
        ssm_state=ssm["state_size"],
        ssm_v_heads=ssm["time_step_rank"],
        ssm_k_heads=ssm["group_count"],
        sliding_window=sliding_window,
        swa_layers=swa_layers,
        rope_theta_swa=_float(meta, path, p + "rope.freq_base_swa", 0.0),
        attn_softcap=_float(meta, path, p + "attn_logit_softcapping", 0.0),
        final_softcap=_float(meta, path, p + "final_logit_softcapping", 0.0),
    )
