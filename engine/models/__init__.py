"""One module per architecture family; the one list of what moechat runs, by `general.architecture`."""

from __future__ import annotations

from ..config import ModelConfig, model_config
from ..gguf.reader import GGUFError
from ..gguf.sources import Layout, ModelFile
from . import deepseek2, gemma3, glm4moe, gpt_oss, llama_moe, olmoe, qwen3next, qwen_moe
from .decode_plan import DecodePlan
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


def family_of(gguf: ModelFile) -> Family:
    """The family that runs this file, or a one-line `GGUFError` naming the architecture and the supported ones."""
    return _family(gguf.architecture, gguf.path)


def config_for(gguf: ModelFile) -> ModelConfig:
    """The file's config, its family filling in what the file leaves implicit."""
    return model_config(gguf, family_of(gguf).metadata)


def build_model(
    layout: Layout, cfg: ModelConfig, n_ctx: int, *, quantized: bool = False, kernels: str = "fast",
    dequant_mib: float = 0.0,
) -> MoeDecoder | Gemma3:  # fmt: skip
    """Step one of two: the modules of `cfg`'s family over `layout` (tensor names, types and shapes),
    every weight a slot that `weights.load_weights` fills (step two) from the file or another source.

    `quantized`: dense matrices stay the file's bytes and run through the CPU kernels (CPU device only).
    `kernels` and `dequant_mib`: how the host experts run (moe.HostExperts).
    """
    family = _family(cfg.arch, layout.path)
    model: MoeDecoder | Gemma3
    if family.decoder is not None:
        model = family.decoder(layout, cfg, n_ctx, quantized=quantized, kernels=kernels, dequant_mib=dequant_mib)
    else:
        model = MoeDecoder(layout, cfg, n_ctx, family, quantized=quantized, kernels=kernels, dequant_mib=dequant_mib)
    model.planner = DecodePlan.build  # one token runs the plan it makes (models.decode_plan)
    return model


def _family(arch: str, path: object) -> Family:
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise GGUFError(f"{path}: unsupported architecture '{arch}' (supported: {', '.join(ARCHITECTURES)})")
    return family
