"""One module per architecture family; `build_model` picks by `general.architecture`."""

from __future__ import annotations

from ..config import ModelConfig
from ..gguf_file import GGUFError, GGUFFile
from . import deepseek2, glm4moe, gpt_oss, llama_moe, olmoe, qwen3next, qwen_moe
from .decoder import Family, MoeDecoder
from .gemma3 import Gemma3

_FAMILIES = {
    "qwen3moe": qwen_moe.FAMILY,
    "qwen2moe": qwen_moe.FAMILY,
    "qwen3": qwen_moe.FAMILY,  # dense: the same decoder without routers
    "qwen2": qwen_moe.FAMILY,
    "llama": llama_moe.FAMILY,  # dense, or with experts (Mixtral)
    "olmoe": olmoe.FAMILY,
    "gpt-oss": gpt_oss.FAMILY,
    "glm4moe": glm4moe.FAMILY,
    "deepseek2": deepseek2.FAMILY,
    "qwen3next": qwen3next.FAMILY,
    "qwen35moe": qwen3next.FAMILY_35,
}


# Gemma 3 has its own decoder (sandwich norms, two rotary bases); it runs dense and MoE-fied.
_GEMMA = ("gemma3", "gemma3moe")


def family_for(gguf: GGUFFile, cfg: ModelConfig) -> Family | None:
    """The family that runs this model (None: Gemma's own decoder), or a one-line `GGUFError`."""
    if cfg.arch in _GEMMA:
        return None
    family = _FAMILIES.get(cfg.arch)
    if family is None:
        raise GGUFError(
            f"{gguf.path}: architecture '{cfg.arch}' cannot be run (moechat runs: "
            f"{', '.join(sorted([*_FAMILIES, *_GEMMA]))})"
        )
    return family


def build_model(
    gguf: GGUFFile, cfg: ModelConfig, n_ctx: int, *, quantized: bool = False, kernels: str = "fast",
    dequant_mib: float = 0.0,
) -> MoeDecoder | Gemma3:  # fmt: skip
    """`quantized`: dense matrices stay the file's bytes and run through the CPU kernels (CPU device only).

    `kernels` and `dequant_mib`: how the host experts run (moe.HostExperts).
    """
    family = family_for(gguf, cfg)
    if family is None:
        return Gemma3(gguf, cfg, n_ctx, quantized=quantized, kernels=kernels, dequant_mib=dequant_mib)
    return MoeDecoder(gguf, cfg, n_ctx, family, quantized=quantized, kernels=kernels, dequant_mib=dequant_mib)
