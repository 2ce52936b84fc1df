"""One module per architecture family; `build_model` picks by `general.architecture`."""

from __future__ import annotations

from torch import nn

from ..config import ModelConfig
from ..gguf_file import GGUFError, GGUFFile


def build_model(gguf: GGUFFile, cfg: ModelConfig, n_ctx: int) -> nn.Module:
    from . import gpt_oss, llama_moe, olmoe, qwen_moe
    from .decoder import MoeDecoder

    families = {
        "qwen3moe": qwen_moe.FAMILY,
        "qwen2moe": qwen_moe.FAMILY,
        "olmoe": olmoe.FAMILY,
        "gpt-oss": gpt_oss.FAMILY,
    }
    if cfg.is_moe:
        families["llama"] = llama_moe.FAMILY
    family = families.get(cfg.arch)
    if family is None:
        kind = "dense " if not cfg.is_moe else ""
        raise GGUFError(
            f"{gguf.path}: {kind}architecture '{cfg.arch}' cannot be run (moechat runs MoE models of: "
            "qwen3moe, qwen2moe, llama with experts, olmoe, gpt-oss)"
        )
    return MoeDecoder(gguf, cfg, n_ctx, family)
