"""The routing trace: every expert lookup of a run, enough to replay it through the cache policy.

Format (little-endian), documented in docs/trace-format.md:
    magic  b"MOECHAT-TRACE1\n"
    u32    header length H, then H bytes of UTF-8 JSON (groups, budget, share, max batch, ...)
    records until the end: i32 layer, i32 n_used, i32 n_ids, then n_ids x i32 expert ids
            (token-major: the n_used experts of token 0, then token 1, ...)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

MAGIC = b"MOECHAT-TRACE1\n"
_REC = struct.Struct("<iii")


class TraceError(ValueError):
    """A trace file that cannot be read."""


@dataclass(frozen=True)
class Record:
    layer: int
    n_used: int
    ids: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.ids) // self.n_used


class TraceWriter:
    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self._f: BinaryIO | None = self.path.open("wb")
        head = json.dumps(header, sort_keys=True).encode("utf-8")
        self._f.write(MAGIC + struct.pack("<I", len(head)) + head)

    def write(self, layer: int, n_used: int, ids: np.ndarray) -> None:
        if self._f is None:
            return
        flat = np.ascontiguousarray(ids, dtype="<i4").reshape(-1)
        self._f.write(_REC.pack(layer, n_used, flat.size) + flat.tobytes())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


@dataclass(frozen=True)
class Trace:
    header: dict[str, Any]
    records: tuple[Record, ...]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)


def read_trace(path: str | Path) -> Trace:
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise TraceError(f"{path}: offset 0: not a moechat trace")
    pos = len(MAGIC)
    if pos + 4 > len(data):
        raise TraceError(f"{path}: offset {pos}: truncated header")
    (n,) = struct.unpack_from("<I", data, pos)
    pos += 4
    try:
        header = json.loads(data[pos : pos + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: offset {pos}: bad header: {e}") from None
    pos += n
    records = []
    while pos < len(data):
        if pos + _REC.size > len(data):
            raise TraceError(f"{path}: offset {pos}: truncated record")
        layer, n_used, n_ids = _REC.unpack_from(data, pos)
        pos += _REC.size
        if n_used <= 0 or n_ids < 0 or n_ids % n_used or pos + 4 * n_ids > len(data):
            raise TraceError(f"{path}: offset {pos - _REC.size}: bad record ({layer}, {n_used}, {n_ids})")
        ids = np.frombuffer(data, dtype="<i4", count=n_ids, offset=pos)
        records.append(Record(layer, n_used, tuple(int(i) for i in ids)))
        pos += 4 * n_ids
    return Trace(header, tuple(records))
