"""Slot groups: layers whose experts have one shape and type share a bank of slots and one policy.

The budget is split over the groups (`cache_policy.split_budget`); each group with slots gets its
ClassLRU and its banks on the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..moe.expert_tensors import LayerExperts
from ..moe.host_experts import HostExperts
from .device_memory import allocate_slots
from .policy import ClassLRU, split_budget
from .stats import GroupInfo

logger = logging.getLogger(__name__)


@dataclass
class SlotGroup:
    info: GroupInfo
    policy: ClassLRU | None  # None: no slots (the group's experts run from the host)
    banks: tuple[torch.Tensor, ...]  # gate, up, down slots: [n_slots, rows, row_bytes] uint8 on the device

    @cached_property
    def host_banks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The banks as arrays the CPU kernels read (the CPU device only)."""
        gate, up, down = (b.numpy() for b in self.banks)
        return gate, up, down


def _geometry(lx: LayerExperts) -> tuple[object, ...]:
    return tuple((tuple(t.raw.shape), t.qtype) for t in (lx.gate, lx.up, lx.down))


def layer_groups(host: HostExperts) -> list[list[int]]:
    """Layers whose expert tensors have the same shapes and types, in layer order: one bank of slots each."""
    by_geometry: dict[tuple[object, ...], list[int]] = {}
    for layer, lx in sorted(host.layers.items()):
        by_geometry.setdefault(_geometry(lx), []).append(layer)
    return list(by_geometry.values())


def build_groups(host: HostExperts, n_expert_used: int, mib: float, cpu_share: float, device: torch.device,
                 policy: str = "classlru", allocate: bool = True) -> list[SlotGroup]:  # fmt: skip
    """The groups of a cache of `mib` MiB on `device`, their slots allocated (unless not `allocate`: slots
    that read the host copy in place); `policy`: what they admit."""
    sizes = []
    for layers in layer_groups(host):
        lx = host.layers[layers[0]]
        sizes.append((layers, lx.gate.raw.shape[0], lx.bytes_per_expert))
    split = split_budget([(len(ls), n, b) for ls, n, b in sizes], int(mib * 2**20), n_expert_used)
    groups = []
    for index, ((layers, n_expert, expert_bytes), (n_slots, share)) in enumerate(zip(sizes, split, strict=True)):
        if n_slots == 0 and share >= expert_bytes:
            logger.warning(
                "MoE cache group %d (layers %s): %d slots cannot hold one token's %d experts: not cached",
                index, span(layers), share // expert_bytes, n_expert_used,
            )  # fmt: skip
        info = GroupInfo(index, tuple(layers), n_expert, expert_bytes, int(n_slots), int(share))
        group = SlotGroup(info, None, ())
        if n_slots:
            group.policy = ClassLRU(layers, n_expert, int(n_slots), policy)
            if allocate:
                group.banks = allocate_slots(host.layers[layers[0]], int(n_slots), device, mib)
            where = f"on {device}" if allocate else "read in place on the CPU device"
            logger.info(
                "MoE cache group %d: layers %s, %d experts of %.2f MiB: %d slots (%.1f%% of the experts, "
                "%.1f tokens worth), %.1f MiB %s, CPU share %g",
                index, span(layers), n_expert, expert_bytes / 2**20, n_slots, 100 * info.fraction,
                n_slots / (len(layers) * n_expert_used), n_slots * expert_bytes / 2**20, where, cpu_share,
            )  # fmt: skip
        groups.append(group)
    return groups


def span(layers: list[int] | tuple[int, ...]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
