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
from collections.abc import Iterator, Sequence
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
        self._f.write(_header_bytes(header))

    def write(self, layer: int, n_used: int, ids: np.ndarray) -> None:
        if self._f is None:
            return
        self._f.write(_record_bytes(layer, n_used, ids))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _header_bytes(header: dict[str, Any]) -> bytes:
    head = json.dumps(header, sort_keys=True).encode("utf-8")
    return MAGIC + struct.pack("<I", len(head)) + head


def _record_bytes(layer: int, n_used: int, ids: np.ndarray) -> bytes:
    flat = np.ascontiguousarray(ids, dtype="<i4").reshape(-1)
    return _REC.pack(layer, n_used, flat.size) + flat.tobytes()


@dataclass(frozen=True)
class Trace:
    header: dict[str, Any]
    records: tuple[Record, ...]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)


def read_trace(path: str | Path) -> Trace:
    return parse_trace(Path(path).read_bytes(), str(path))


def parse_trace(data: bytes, path: str) -> Trace:
    """A trace from its bytes; `path` names it in errors."""
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


def join_stages(parts: Sequence[bytes]) -> bytes:
    """One trace from the traces of a split model's stages (rank order), as one process would have
    recorded it: forward by forward, each stage's lookups after the stage before it.

    Each stage's cache sees every forward once and looks up each of its MoE layers once per forward
    (a prefetch's record comes before its layer's lookup), so a stage's forward ends with the lookup
    of its last MoE layer. The header lists every stage's groups; `stages` says which groups each
    stage held, since each stage sized its slots from its own budget (`budget_mib`, the same on all)."""
    traces = [parse_trace(data, f"stage {i}") for i, data in enumerate(parts)]
    heads = [t.header for t in traces]
    shared = ("version", "max_batch", "n_expert_used", "budget_mib", "cpu_share", "policy", "prefetch")
    for i, h in enumerate(heads[1:], 1):
        differ = [k for k in shared if h.get(k) != heads[0].get(k)]
        if differ:
            raise TraceError(f"stage {i}: its trace differs from stage 0's in {', '.join(differ)}")
    header: dict[str, Any] = {k: heads[0].get(k) for k in shared}
    groups: list[Any] = []
    stages: list[list[int]] = []
    warm: dict[str, Any] = {}
    forwards: list[list[list[Record]]] = []
    for h, t in zip(heads, traces, strict=True):
        first = len(groups)
        groups += h["groups"]
        stages.append(list(range(first, len(groups))))
        warm.update(h.get("warm") or {})
        last = max((layer for g in h["groups"] for layer in g["layers"]), default=None)
        chunks: list[list[Record]] = [[]]
        for r in t.records:
            chunks[-1].append(r)
            if r.layer == last:
                chunks.append([])
        if chunks[-1]:
            raise TraceError(f"stage {len(forwards)}: its trace ends inside a forward")
        forwards.append(chunks[:-1])
    counts = {len(f) for f in forwards if f}
    if len(counts) > 1:
        raise TraceError(f"the stages' traces hold different numbers of forwards ({sorted(counts)})")
    header["groups"], header["stages"] = groups, stages
    header["warm"] = warm if any(h.get("warm") is not None for h in heads) else None
    out = bytearray(_header_bytes(header))
    for step in range(counts.pop() if counts else 0):
        for stage in forwards:
            for r in stage[step] if stage else ():
                out += _record_bytes(r.layer, r.n_used, np.asarray(r.ids))
    return bytes(out)
