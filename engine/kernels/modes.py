"""How a model's matrices run on the CPU: light, so the CLI can list the modes
without loading the engine."""

from __future__ import annotations

KERNEL_MODES = {
    "fast": "the default: kernels that read the file's quantized blocks in place, activations rounded to int16",
    "int8": "the same kernels with int8 activations everywhere (llama.cpp's approximation): faster, less exact",
    "exact": "dequantize with torch, then multiply in float32: the slow reference path",
}


def describe() -> str:
    """The modes in one line, for a command's help."""
    return "; ".join(f"{name}: {what}" for name, what in KERNEL_MODES.items())
