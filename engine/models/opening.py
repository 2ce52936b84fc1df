"""Opening a model file for running: the GGUF, its config, and the check that we can run it."""

from __future__ import annotations

import os
from collections import Counter

from gguf import GGMLQuantizationType

from ..config import ModelConfig
from ..gguf import dequant as quants
from ..gguf.reader import GGUFError, GGUFFile
from . import config_for


def unsupported_tensors(gguf: GGUFFile) -> list[tuple[str, GGMLQuantizationType]]:
    return [(t.name, t.qtype) for t in gguf.tensors.values() if not quants.is_supported(t.qtype)]


def quant_histogram(gguf: GGUFFile) -> Counter[str]:
    return Counter(t.qtype.name for t in gguf.tensors.values())


def open_model(path: str | os.PathLike[str]) -> tuple[GGUFFile, ModelConfig]:
    """Open and validate a model: a bad file raises `GGUFError` now, never mid-generation."""
    gguf = GGUFFile(path)
    try:
        config = config_for(gguf)
        bad = unsupported_tensors(gguf)
        if bad:
            name, qtype = bad[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            names = ", ".join(sorted(t.name for t in quants.supported_types()))
            raise GGUFError(
                f"{gguf.path}: tensor '{name}' has unsupported quant type {qtype.name}{more}; supported: {names}"
            )
    except BaseException:
        gguf.close()
        raise
    return gguf, config
