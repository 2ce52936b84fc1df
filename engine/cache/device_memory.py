"""Memory on the cache's device: what is free, slot banks allocated with a clear error, pinned host copies."""

from __future__ import annotations

import dataclasses
import logging
import weakref

import torch

from ..moe.expert_tensors import LayerExperts
from ..moe.host_experts import HostExperts
from .settings import CacheError

logger = logging.getLogger(__name__)


def device_free_bytes(device: torch.device) -> int:
    """Memory the device can still give: CUDA's free memory, or the host's available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62  # unknown: let the allocator decide


def allocate_slots(lx: LayerExperts, n_slots: int, device: torch.device, mib: float) -> tuple[torch.Tensor, ...]:
    """Gate, up and down banks of `n_slots` experts shaped like `lx`'s: [n_slots, rows, row_bytes] uint8.

    `mib`: the cache size asked for, which the error's advice scales."""
    need = n_slots * lx.bytes_per_expert
    free = device_free_bytes(device)
    if need > free:
        # Say so before the allocator fails somewhere less clear, and propose what fits.
        # Every group takes the same fraction of the budget, so scaling the budget scales this group.
        fits = mib * 0.9 * free / need
        raise CacheError(
            "mib",
            f"a cache of {mib:g} MiB: the slots need {need / 2**20:.0f} MiB "
            f"but {device} has {free / 2**20:.0f} MiB free",
            suggestion=int(fits),
        )
    banks = []
    try:
        for t in (lx.gate, lx.up, lx.down):
            banks.append(torch.empty((n_slots, *t.raw.shape[1:]), dtype=torch.uint8, device=device))
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise CacheError(
            "mib",
            f"a cache of {mib:g} MiB: cannot allocate {need / 2**20:.0f} MiB of expert slots on {device} "
            f"({str(e).splitlines()[0]})",
            suggestion=int(mib / 2),
        ) from None
    return tuple(banks)


_PINNED: weakref.WeakKeyDictionary[HostExperts, HostExperts] = weakref.WeakKeyDictionary()


def pinned(host: HostExperts) -> HostExperts:
    """A copy of the host experts in pinned (page-locked) memory: uploads then run at link speed.

    Made once per model and kept while the model lives: each cache made for it (the tuner's arms)
    reuses it. The copy keeps the CPU execution options (kernels, dequant budget).
    """
    if host in _PINNED:
        return _PINNED[host]
    layers = {}
    for layer, lx in host.layers.items():
        tensors = []
        for t in (lx.gate, lx.up, lx.down):
            page_locked = torch.empty(t.raw.shape, dtype=torch.uint8, pin_memory=True)
            page_locked.copy_(t.raw)
            tensors.append(dataclasses.replace(t, raw=page_locked))
        layers[layer] = LayerExperts(*tensors)
    logger.info("experts copied to pinned memory")
    copy = _PINNED[host] = host.with_layers(layers)
    return copy
