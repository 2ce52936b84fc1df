"""A model file's identity: the hash of its first 16 MiB and its size (cheap, and enough to tell files apart).

The warm start and the tuned settings are keyed by it, and the ranks of a split model compare it
before any work: each host must run the very same file."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


def file_identity(path: Path) -> str:
    """Hashed once per file version in a process: the settings' lookup of tuned values and the warm
    start of one start ask for the same file."""
    st = path.stat()
    return _identity(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.cache
def _identity(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(16 << 20))
    h.update(str(size).encode())
    return h.hexdigest()
