"""A model split by layers over several hosts (torch.distributed): the plan of who holds what, each
rank's part, rank 0's pipeline. This package's own namespace imports no torch: `launched` is asked by
the app's UI process too."""

from __future__ import annotations

import os


def launched() -> tuple[int, int] | None:
    """(rank, world size) when torchrun started this process as a rank of a group of several, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return (int(os.environ.get("RANK", "0") or 0), world) if world > 1 else None
