"""How a model's matrices run on the CPU: light, so the CLI can list the modes
without loading the engine."""

from __future__ import annotations

KERNEL_MODES = {
    "fast": "the default: kernels that read the file's quantized blocks in place; a few tokens' activations "
    "rounded to int8 where this CPU multiplies bytes faster (x86 with AVX2 or AVX-512), else int16; a prompt's "
    "super-block types in integer tiles (int8 with AVX512-VNNI, else int16), its other experts as a few tokens",
    "int16": "the same kernels with int16 activations everywhere: the closest to exact",
    "int8": "the same kernels with int8 activations everywhere (llama.cpp's approximation)",
    "exact": "dequantize with torch, then multiply in float32: the slow reference path",
}


def describe() -> str:
    """The modes in one line, for a command's help."""
    return "; ".join(f"{name}: {what}" for name, what in KERNEL_MODES.items())
