"""One module per architecture family; `build_model` picks by `general.architecture`."""

from __future__ import annotations

from torch import nn

from ..config import ModelConfig
from ..gguf_file import GGUFError, GGUFFile


def build_model(gguf: GGUFFile, cfg: ModelConfig, n_ctx: int) -> nn.Module:
    from .qwen_moe import QwenMoe

    families: dict[str, type[nn.Module]] = {"qwen3moe": QwenMoe, "qwen2moe": QwenMoe}
    family = families.get(cfg.arch)
    if family is None:
        raise GGUFError(f"{gguf.path}: architecture '{cfg.arch}' cannot be run yet (runs: {', '.join(families)})")
    return family(gguf, cfg, n_ctx)
