"""Process-wide memory tuning for the engine."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(threshold: int = 1 << 30) -> bool:
    """Keep large freed blocks in the heap instead of returning them to the OS.

    Dequantization makes multi-MB temporaries on every call; with glibc's defaults each one is
    a fresh mmap whose pages fault in again, which dominated eager dequantization here
    (20 ms -> 6 ms per call with higher thresholds). Returns False where there is no glibc.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * threshold))
    logger.debug("mallopt thresholds raised to %d bytes: %s", threshold, ok)
    return ok
