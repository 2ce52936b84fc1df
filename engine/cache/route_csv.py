"""Routing recorded by another engine: the "route_trace v1" CSV, read as a `Routing` the simulator replays.

The format: `#` lines first, `# route_trace v1`, then one with the model's `n_layer`, `n_expert` and
`n_expert_used`, then one per layer with its `expert_bytes` (`# layer=3 expert_bytes=4336640 ...`);
then a header row and one row per selected expert:
`turn,phase,step,layer,slot,expert,weight,residency,expert_bytes`. The rows of one (turn, phase,
step, layer) are one token's lookup of that layer, its experts in slot order. Each step is one token:
another engine that recorded its prompt token by token is replayed so, and its prompt tokens count
toward the warm-up like any other. As in moechat's engine, layers whose experts have the same size
share one bank of slots. The recording engine's own residency column is not used: the replay asks our
policy what it would have held. A row's expert_bytes of 0 means not given (the header's stands).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAGIC = "# route_trace v1"
COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes")


def is_route_csv(path: str | Path) -> bool:
    """Whether the file says it is a route_trace (of any version: the reader then names the one it reads)."""
    try:
        with open(path, "rb") as f:
            return f.read(len("# route_trace")) == b"# route_trace"
    except OSError:
        return False


def _fields(text: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in text.split() if "=" in p)


def _int(value: str, what: str, where: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{where}: {what} '{value}' is not a whole number") from None


@dataclass(frozen=True)
class RouteTrace:
    """What the simulator's Routing is built from: the banks (layers, experts, bytes each), the experts a
    token selects per layer, and each lookup (layer, experts per token, ids)."""

    banks: tuple[tuple[tuple[int, ...], int, int], ...]
    n_expert_used: int
    records: tuple[tuple[int, int, tuple[int, ...]], ...]
    steps: tuple[tuple[int, int, int], ...] = ()  # each record's (turn, phase, step): the token it belongs to


def read_route_csv(path: str | Path) -> RouteTrace:
    """The trace's banks and lookups; ValueError naming the file and line for anything malformed."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}: cannot read ({e})") from None
    lines = text.splitlines()
    if not lines or lines[0].strip() != MAGIC:
        raise ValueError(f"{name}:1: not a route_trace v1 file (its first line must be '{MAGIC}')")
    model: dict[str, str] = {}
    expert_bytes: dict[int, int] = {}
    body = len(lines)
    for i, line in enumerate(lines[1:], 2):
        if not line.startswith("#"):
            body = i - 1
            break
        f = _fields(line[1:])
        where = f"{name}:{i}"
        if "layer" in f:
            if "expert_bytes" not in f:
                raise ValueError(f"{where}: a layer line without expert_bytes")
            expert_bytes[_int(f["layer"], "layer", where)] = _int(f["expert_bytes"], "expert_bytes", where)
        else:
            model.update(f)
    try:
        n_layer, n_expert, n_used = (int(model[k]) for k in ("n_layer", "n_expert", "n_expert_used"))
    except KeyError as e:
        raise ValueError(f"{name}: the header lacks {e.args[0]} (n_layer, n_expert, n_expert_used)") from None
    except ValueError:
        raise ValueError(f"{name}: the header's n_layer, n_expert or n_expert_used is not a whole number") from None
    if n_expert <= 0 or n_used <= 0 or n_used > n_expert:
        raise ValueError(f"{name}: the header's n_expert {n_expert} and n_expert_used {n_used} do not fit together")
    records: list[tuple[int, int, tuple[int, ...]]] = []
    steps: list[tuple[int, int, int]] = []
    for key, ids, where in _lookups(lines, body, name, n_layer, n_expert, expert_bytes):
        if len(ids) != n_used:
            raise ValueError(f"{where}: layer {key[3]} at step {key[2]} selects {len(ids)} experts, "
                             f"not n_expert_used = {n_used}")  # fmt: skip
        records.append((key[3], n_used, ids))
        steps.append(key[:3])
    if not records:
        raise ValueError(f"{name}: no rows of routing")
    used = sorted({layer for layer, _, _ in records})
    missing = [layer for layer in used if layer not in expert_bytes]
    if missing:
        raise ValueError(f"{name}: no '# layer={missing[0]} expert_bytes=...' line for a layer the rows select in")
    banks: dict[int, list[int]] = {}
    for layer in used:
        banks.setdefault(expert_bytes[layer], []).append(layer)
    return RouteTrace(
        tuple((tuple(layers), n_expert, size) for size, layers in banks.items()), n_used, tuple(records), tuple(steps)
    )


def _lookups(lines: list[str], body: int, name: str, n_layer: int, n_expert: int, expert_bytes: dict[int, int]
             ) -> Iterator[tuple[tuple[int, int, int, int], tuple[int, ...], str]]:  # fmt: skip
    """Each (turn, phase, step, layer)'s experts in slot order, with the line the lookup starts on."""
    reader = csv.reader(lines[body:])
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != COLUMNS:
        raise ValueError(f"{name}:{body + 1}: the column header must be {','.join(COLUMNS)}")
    key: tuple[int, int, int, int] | None = None
    slots: list[tuple[int, int]] = []
    start = ""
    for i, row in enumerate(reader, body + 2):
        where = f"{name}:{i}"
        if not row:
            continue
        if len(row) != len(COLUMNS):
            raise ValueError(f"{where}: {len(row)} fields, not {len(COLUMNS)}")
        turn, phase, step, layer, slot, expert = (_int(row[k], COLUMNS[k], where) for k in range(6))
        try:
            float(row[6])
        except ValueError:
            raise ValueError(f"{where}: weight '{row[6]}' is not a number") from None
        if not 0 <= layer < n_layer:
            raise ValueError(f"{where}: layer {layer} is outside 0..{n_layer - 1}")
        if not 0 <= expert < n_expert:
            raise ValueError(f"{where}: expert {expert} is outside 0..{n_expert - 1}")
        size = _int(row[8], "expert_bytes", where) if row[8].strip() else 0  # 0: not given on this row
        if layer in expert_bytes and size and size != expert_bytes[layer]:
            raise ValueError(f"{where}: expert_bytes {row[8]} differs from the header's {expert_bytes[layer]} "
                             f"for layer {layer}")  # fmt: skip
        now = (turn, phase, step, layer)
        if now != key:
            if key is not None:
                yield key, tuple(e for _, e in sorted(slots)), start
            key, slots, start = now, [], where
        if any(e == expert for _, e in slots):
            raise ValueError(f"{where}: expert {expert} selected twice in one lookup")
        slots.append((slot, expert))
    if key is not None:
        yield key, tuple(e for _, e in sorted(slots)), start
