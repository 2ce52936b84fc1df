"""One module per architecture family; the one list of what moechat runs, by `general.architecture`."""

from __future__ import annotations

from ..config import ModelConfig, model_config
from ..gguf_file import GGUFError, GGUFFile
from . import deepseek2, gemma3, glm4moe, gpt_oss, llama_moe, olmoe, qwen3next, qwen_moe
from .decoder import Family, MoeDecoder
from .gemma3 import Gemma3

ARCHITECTURES: dict[str, Family] = {
    "qwen3moe": qwen_moe.QWEN3,
    "qwen2moe": qwen_moe.QWEN2,
    "qwen3": qwen_moe.QWEN3,  # dense: the same decoder without routers
    "qwen2": qwen_moe.QWEN2,
    "llama": llama_moe.FAMILY,  # dense, or with experts (Mixtral)
    "olmoe": olmoe.FAMILY,
    "gpt-oss": gpt_oss.FAMILY,
    "glm4moe": glm4moe.FAMILY,
    "deepseek2": deepseek2.FAMILY,
    "qwen3next": qwen3next.FAMILY,
    "qwen35moe": qwen3next.FAMILY_35,
    "gemma3": gemma3.FAMILY,
    "gemma3moe": gemma3.FAMILY_MOE,  # the Gemma demo's experts
}


def family_of(gguf: GGUFFile) -> Family:
    """The family that runs this file, or a one-line `GGUFError` naming the architecture and the supported ones."""
    family = ARCHITECTURES.get(gguf.architecture)
    if family is None:
        raise GGUFError(
            f"{gguf.path}: unsupported architecture '{gguf.architecture}' (supported: {', '.join(ARCHITECTURES)})"
        )
    return family


def config_for(gguf: GGUFFile) -> ModelConfig:
    """The file's config, its family filling in what the file leaves implicit."""
    return model_config(gguf, family_of(gguf).metadata)


def build_model(
    gguf: GGUFFile, cfg: ModelConfig, n_ctx: int, *, quantized: bool = False, kernels: str = "fast",
    dequant_mib: float = 0.0,
) -> MoeDecoder | Gemma3:  # fmt: skip
    """`quantized`: dense matrices stay the file's bytes and run through the CPU kernels (CPU device only).

    `kernels` and `dequant_mib`: how the host experts run (moe.HostExperts).
    """
    family = family_of(gguf)
    if family.decoder is not None:
        model: MoeDecoder | Gemma3 = family.decoder(gguf, cfg, n_ctx, quantized=quantized, kernels=kernels,
                                                    dequant_mib=dequant_mib)  # fmt: skip
        return model
    return MoeDecoder(gguf, cfg, n_ctx, family, quantized=quantized, kernels=kernels, dequant_mib=dequant_mib)
