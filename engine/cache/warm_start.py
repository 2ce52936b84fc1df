"""Warm start: each expert's decayed use count, kept from one run of a model to the next.

At exit the cache writes, per MoE layer, every expert's combined recency and frequency (the
policy's CRF, decayed to the end of the run); a new cache of the same model fills its slots
with the hottest of them before the first token, so the first replies do not start cold. The
file is JSON beside the user's other data, one per model (the app names it by the file's
identity). A file that cannot be read, or that describes other layers or expert counts (another
model), is ignored with a warning and replaced at the next exit.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

VERSION = 1

Counts = dict[int, list[float]]  # MoE layer -> one decayed use count per expert


def read(path: Path, n_expert: Mapping[int, int]) -> Counts | None:
    """The counts saved at `path` for a model of these layers (layer -> experts), or None."""
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        if d.get("version") != VERSION:
            raise ValueError(f"version {d.get('version')!r}, not {VERSION}")
        counts = {int(layer): [float(c) for c in values] for layer, values in d["layers"].items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning("warm start: %s is not readable (%s); starting cold", path, e)
        return None
    if sorted(counts) != sorted(n_expert) or any(len(counts[layer]) != n for layer, n in n_expert.items()):
        logger.warning("warm start: %s describes another model's layers; starting cold", path)
        return None
    if any(not math.isfinite(c) or c < 0 for values in counts.values() for c in values):
        logger.warning("warm start: %s holds counts that are not finite and >= 0; starting cold", path)
        return None
    return counts


def write(path: Path, counts: Counts) -> None:
    """Save atomically (a crash mid-write leaves the old file); a failure is logged, never raised."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"version": VERSION, "layers": {str(k): [round(c, 4) for c in v] for k, v in sorted(counts.items())}}
        tmp.write_text(json.dumps(payload), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("warm start: could not save %s (%s)", path, e)


def hottest(counts: Counts, layers: Sequence[int], n: int) -> list[tuple[int, int, float]]:
    """The n (layer, expert, count) with the largest counts over `layers` (count > 0), hottest first."""
    picks = [(c, layer, e) for layer in layers for e, c in enumerate(counts.get(layer, ())) if c > 0]
    picks.sort(key=lambda p: (-p[0], p[1], p[2]))
    return [(layer, e, c) for c, layer, e in picks[:n]]
