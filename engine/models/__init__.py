"""One module per architecture family; `build_model` picks by `general.architecture`."""

from __future__ import annotations

from ..config import ModelConfig
from ..gguf_file import GGUFError, GGUFFile
from . import gpt_oss, llama_moe, olmoe, qwen_moe
from .decoder import Family, MoeDecoder

_MOE_FAMILIES = {
    "qwen3moe": qwen_moe.FAMILY,
    "qwen2moe": qwen_moe.FAMILY,
    "llama": llama_moe.FAMILY,  # with experts: Mixtral
    "olmoe": olmoe.FAMILY,
    "gpt-oss": gpt_oss.FAMILY,
}


def family_for(gguf: GGUFFile, cfg: ModelConfig) -> Family:
    """The family that runs this model, or a one-line `GGUFError` saying why none does."""
    family = _MOE_FAMILIES.get(cfg.arch) if cfg.is_moe else None
    if family is None:
        kind = "dense " if not cfg.is_moe else ""
        raise GGUFError(
            f"{gguf.path}: {kind}architecture '{cfg.arch}' cannot be run (moechat runs MoE models of: "
            "qwen3moe, qwen2moe, llama with experts, olmoe, gpt-oss)"
        )
    return family


def build_model(gguf: GGUFFile, cfg: ModelConfig, n_ctx: int) -> MoeDecoder:
    return MoeDecoder(gguf, cfg, n_ctx, family_for(gguf, cfg))
