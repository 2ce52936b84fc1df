"""Uploads into the slots: runs of experts in one copy each, on a copy stream (CUDA) or through an emulated link.

On CUDA the copies go on their own stream, ordered against the compute stream by events. On the
CPU device an emulated link makes each upload also cost bytes / link speed, as over PCIe.
"""

from __future__ import annotations

import time

import torch

from .moe import LayerExperts
from .slot_groups import SlotGroup

LINK_MIN_SLEEP = 2e-3  # seconds


class Uploader:
    def __init__(self, device: torch.device, emulate_link_gbps: float = 0.0) -> None:
        self.device = device
        self.link_gbps = emulate_link_gbps
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._link_debt = 0.0  # seconds of emulated link time not yet waited

    def upload(self, group: SlotGroup, lx: LayerExperts, uploads: tuple[tuple[int, int], ...]) -> None:
        """Copy each (expert, slot) of `uploads` from the host copy `lx` into the group's banks."""
        if not uploads:
            return
        # Runs of consecutive experts into consecutive slots go in one copy.
        runs: list[tuple[int, int, int]] = []
        for e, s in uploads:
            if runs and runs[-1][0] + runs[-1][2] == e and runs[-1][1] + runs[-1][2] == s:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((e, s, 1))
        if self._copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            self._copy_stream.wait_stream(compute)  # a slot is overwritten only after its last reader ran
            with torch.cuda.stream(self._copy_stream):
                _copy_runs(group, lx, runs)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
            compute.wait_event(done)  # the device computes with the new experts once they are in
            return
        _copy_runs(group, lx, runs)
        if self.link_gbps:
            # The device waits for its experts: each upload costs bytes / link speed, serially.
            # Sleeps of well under a millisecond overshoot by tens of microseconds, so small costs
            # add up to a debt first, and what a sleep overshoots is paid back from the next.
            self._link_debt += len(uploads) * group.info.expert_bytes / (self.link_gbps * 1e9)
            if self._link_debt > LINK_MIN_SLEEP:
                t = time.perf_counter()
                time.sleep(self._link_debt)
                self._link_debt -= time.perf_counter() - t


def _copy_runs(group: SlotGroup, lx: LayerExperts, runs: list[tuple[int, int, int]]) -> None:
    for e, s, n in runs:
        for bank, t in zip(group.banks, (lx.gate, lx.up, lx.down), strict=True):
            bank[s : s + n].copy_(t.raw[e : e + n], non_blocking=True)
