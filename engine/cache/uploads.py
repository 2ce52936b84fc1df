"""Uploads into the slots: runs of experts in one copy each, on a copy stream (CUDA) or through an emulated link.

On CUDA the copies go on their own stream, ordered against the compute stream by events. On the
CPU device an emulated link makes each upload also cost bytes / link speed, as over PCIe: the
link is busy until a time, uploads queue on it, and the device waits for what it needs.

An upload `ahead` (a prefetch) does not make the device wait: on CUDA the compute stream waits
for its copies only when the layer's lookup comes (`wait_ahead`), on the emulated link its time
runs on while the device computes, and the lookup waits for the rest.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from ..moe.expert_tensors import LayerExperts
from .slot_groups import SlotGroup

LINK_MIN_SLEEP = 2e-3  # seconds


class Clock(Protocol):
    """The emulated link's time: what it reads, and how the device waits for it."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Uploader:
    def __init__(self, device: torch.device, emulate_link_gbps: float = 0.0, clock: Clock | None = None) -> None:
        self.device = device
        self.clock = clock or WallClock()
        self.link_gbps = emulate_link_gbps
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._link_free = 0.0  # emulated link: the clock's time when its queued uploads are done
        self._debt = 0.0  # seconds the device owes the link and has not slept yet
        self._ahead: torch.cuda.Event | None = None  # CUDA: the last copies made ahead, not yet waited for

    def upload(self, group: SlotGroup, lx: LayerExperts, uploads: tuple[tuple[int, int], ...],
               ahead: bool = False) -> None:  # fmt: skip
        """Copy each (expert, slot) of `uploads` from the host copy `lx` into the group's banks.

        `ahead`: a prefetch; the device waits for it only at `wait_ahead`."""
        if not uploads:
            return
        if not group.banks:  # the slots are the host copy (ExpertCache.in_place): only the link's time
            self._on_link(len(uploads) * group.info.expert_bytes, self.clock.now(), ahead)
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
            if ahead:
                self._ahead = done
            else:
                compute.wait_event(done)  # the device computes with the new experts once they are in
            return
        began = self.clock.now()
        _copy_runs(group, lx, runs)
        self._on_link(len(uploads) * group.info.expert_bytes, began, ahead)

    def carried(self, n_bytes: int) -> None:
        """Uploads into slots that are the host copy, told after the device computed with them (a decode
        token's lookups accounted at once): the device waits for their time on the emulated link."""
        if n_bytes:
            self._on_link(n_bytes, self.clock.now(), False)

    def _on_link(self, n_bytes: int, began: float, ahead: bool) -> None:
        """The emulated link carries `n_bytes` from `began`: the device waits for them unless `ahead`."""
        if not self.link_gbps:
            return
        # Each upload costs bytes / link speed, serially after what the link already carries, and
        # a copy made for it is that transfer (a link's DMA is the copy): it counts toward the link's
        # time, not on top of it. The device's own time is when the upload began plus what it
        # still owes: compute never absorbs link time.
        now = self.clock.now()
        start = max(began + self._debt, self._link_free)
        self._link_free = start + n_bytes / (self.link_gbps * 1e9)
        if not ahead:
            self._debt = self._link_free - now  # the device waits for its experts
            self._pay()

    def told(self, n_bytes: int, began: float, ahead: bool) -> None:
        """`_on_link` for uploads told after the device computed (a decode token's lookups and prefetches,
        accounted at once, in order): `began` is the clock's time when the device asked for them. What the
        device then owes it pays at `pay`, at the token's end: its time from `began` on is later by it."""
        if not self.link_gbps or not n_bytes:
            return
        start = max(began + self._debt, self._link_free)
        self._link_free = start + n_bytes / (self.link_gbps * 1e9)
        if not ahead:
            self._debt = max(self._debt, self._link_free - began)

    def waited(self, at: float) -> None:
        """As `wait_ahead`, told afterwards: a lookup at the clock's time `at` read experts uploaded ahead."""
        if self.link_gbps:
            self._debt = max(self._debt, self._link_free - at)

    def pay(self) -> None:
        """The device waits now for what `told` and `waited` found it owes."""
        if self.link_gbps:
            self._pay()

    def wait_ahead(self) -> None:
        """The device waits for the uploads made ahead (and, on the emulated link, all queued before)."""
        if self._ahead is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ahead)
            self._ahead = None
        elif self.link_gbps:
            now = self.clock.now()
            self._debt = max(self._debt, self._link_free - now)  # what the link still carries
            self._pay()

    def _pay(self) -> None:
        # Sleeps of well under a millisecond overshoot by tens of microseconds, so small waits add
        # up to a debt first, and what a sleep overshoots is paid back from the next.
        if self._debt > LINK_MIN_SLEEP:
            t = self.clock.now()
            self.clock.sleep(self._debt)
            self._debt -= self.clock.now() - t


def _copy_runs(group: SlotGroup, lx: LayerExperts, runs: list[tuple[int, int, int]]) -> None:
    for e, s, n in runs:
        for bank, t in zip(group.banks, (lx.gate, lx.up, lx.down), strict=True):
            bank[s : s + n].copy_(t.raw[e : e + n], non_blocking=True)
