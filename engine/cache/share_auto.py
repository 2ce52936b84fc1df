"""`--moe-cache-cpu-share auto`: the share of a full cache's misses the CPU computes, from two speeds.

A miss either waits for its expert's upload over the link or is computed on the CPU from the host
copy; both read the expert's bytes once. The share is the closed form of the design this cache
comes from, in the two speeds:

    s* = 1 - B_link / B_cpu   (0 where the link is the faster)

(`policy.closed_form_share`, which the tuner's time model prints beside its replayed table). The two speeds come from a
short probe at the first load on a machine, kept in a file (`CacheSettings.speeds_file`) and reused after; `moechat
inspect MODEL --fit --remeasure` measures again:

- the link: on CUDA a pinned copy of LINK_PROBE_MIB to the device (from pageable memory where the
  experts stay in the file map, `load_mode` mmap); on the CPU device `--emulate-link-gbps` as given,
  and with no emulated link an upload is a copy in the same memory: no share (the CPU device's
  cache then shows the policy's statistics, not a speed trade);
- the CPU: one token's experts of this model through the CPU kernels (decode's width), other experts
  each call so that they come from memory as misses do, for up to CPU_PROBE_S.

A tuned per-model share and a flag are numbers, not auto: they win (app.settings' layers).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..moe.host_experts import HostExperts
from .policy import closed_form_share
from .settings import AUTO_SHARE, CacheSettings

logger = logging.getLogger(__name__)

LINK_PROBE_MIB = 64
CPU_PROBE_S = 0.25  # the CPU probe's time; it stops sooner once every expert was read once


@dataclass(frozen=True)
class Speeds:
    """The two speeds behind an auto share, in GB/s, and whether this load measured them."""

    link_gbps: float
    cpu_gbps: float
    measured: bool

    @property
    def share(self) -> float:
        return closed_form_share(self.link_gbps, self.cpu_gbps)

    def line(self) -> str:
        if math.isinf(self.link_gbps):
            return "CPU share (auto): 0: on the CPU device with no emulated link an upload is a copy in the same memory"
        how = "measured now" if self.measured else "measured earlier on this machine"
        again = "moechat inspect MODEL --fit --remeasure measures again"
        return (f"CPU share (auto): {self.share:.2f} = 1 - link {self.link_gbps:.1f} GB/s / CPU experts "
                f"{self.cpu_gbps:.1f} GB/s ({how}; {again})")  # fmt: skip


def no_link(settings: CacheSettings) -> bool:
    """The CPU device with no emulated link: an upload is a copy in the same memory, nothing to trade against."""
    return settings.device == "cpu" and not settings.emulate_link_gbps


NO_LINK = Speeds(math.inf, 0.0, False)  # what `speeds` gives there: no share, nothing measured


def link_gbps(settings: CacheSettings) -> float:
    """The link's speed for uploads to the cache's device: on CUDA measured now (a copy of LINK_PROBE_MIB),
    on the CPU device the emulated link's (math.inf: none)."""
    if settings.device == "cpu":
        return settings.emulate_link_gbps or math.inf
    n = LINK_PROBE_MIB * 2**20
    src = torch.empty(n, dtype=torch.uint8, pin_memory=settings.load_mode == "pinned")
    return _copy_gbps(src, torch.empty(n, dtype=torch.uint8, device=settings.device), non_blocking=True)


def device_gbps(device: str, cpu: float) -> float:
    """GB/s the cache's device reads its weights at: on CUDA measured now (a copy within the device, which
    reads and writes each byte); the CPU device is the CPU, which computes experts at `cpu`."""
    if device == "cpu":
        return cpu
    n = LINK_PROBE_MIB * 2**20
    src, dst = (torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2))
    return 2 * _copy_gbps(src, dst)


def _copy_gbps(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> float:
    """GB/s of copying src into dst on a CUDA device: three copies timed after one that sets up the path."""
    dst.copy_(src)
    torch.cuda.synchronize(dst.device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=non_blocking)
    torch.cuda.synchronize(dst.device)
    return 3 * src.numel() / (time.perf_counter() - t0) / 1e9


def cpu_gbps(host: HostExperts, n_expert_used: int, seconds: float = CPU_PROBE_S, rounds: int = 3) -> float:
    """GB/s of expert bytes the CPU computes one token's k experts at: other experts each call, as misses.

    Every layer's kernels are called once before the clock starts (a layer of other types compiles or loads
    its own: a first start timed that compile, 0.2 GB/s against 7.8 measured again), and the speed is the
    best of `rounds` short rounds, so that a burst of another process's work (a first start's compiling
    helper) does not become the speed the share is kept at."""
    layers = sorted(host.layers)
    first = host.layers[layers[0]]
    n_expert, n_embd = first.gate.raw.shape[0], first.gate.cols
    k = max(1, min(n_expert_used, n_expert))
    x = torch.randn(1, n_embd, generator=torch.Generator().manual_seed(0))
    w = torch.full((1, k), 1.0 / k)

    def call(i: int) -> int:
        layer = layers[i % len(layers)]
        start = i // len(layers) * k
        ids = torch.tensor([[(start + j) % n_expert for j in range(k)]])
        host(layer, x, ids, w)
        return k * host.layers[layer].bytes_per_expert

    kinds: dict[tuple[str, ...], int] = {}  # one layer of each kind of experts: their kernels, not timed
    for i, layer in enumerate(layers):
        lx = host.layers[layer]
        kinds.setdefault((lx.gate.qtype.name, lx.up.qtype.name, lx.down.qtype.name), i)
    for i in kinds.values():
        call(i)
    all_read = math.ceil(n_expert / k) * len(layers)  # calls that read every expert once
    best, i = 0.0, len(layers)
    for _ in range(max(1, rounds)):
        done, n, t0 = 0, 0, time.perf_counter()
        while n < all_read and (n < 4 or time.perf_counter() - t0 < seconds / rounds):
            done += call(i)
            i, n = i + 1, n + 1
        best = max(best, done / (time.perf_counter() - t0) / 1e9)
    return best


def _cpu_name() -> str:
    """The CPU's model name (a home folder may move between machines), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_key(host: HostExperts) -> str:
    """What the CPU probe's speed depends on: the CPU, its threads, the experts' types and kernels."""
    types = sorted({t.qtype.name for lx in host.layers.values() for t in (lx.gate, lx.up, lx.down)})
    return f"{_cpu_name()}|{os.cpu_count()}|{torch.get_num_threads()}|{'+'.join(types)}|{host.kernels}"


def _link_key(settings: CacheSettings) -> str:
    name = torch.cuda.get_device_name(torch.device(settings.device)) if settings.device != "cpu" else "cpu"
    return f"{name}|{settings.load_mode}"


def _read(path: Path | None) -> dict[str, dict[str, float]]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path | None, data: dict[str, dict[str, float]]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:  # a read-only home: the next load measures again
        logger.debug("cannot keep the probe's speeds in %s: %s", path, e)


def speeds(settings: CacheSettings, host: HostExperts, n_expert_used: int, remeasure: bool = False,
           measure_cpu: Callable[[HostExperts, int], float] = cpu_gbps) -> Speeds:  # fmt: skip
    """The link's and the CPU's speeds for this cache: kept ones where the file has them (unless
    `remeasure`), else measured now and kept."""
    if no_link(settings):
        return NO_LINK  # the CPU need not be measured
    link = settings.emulate_link_gbps if settings.device == "cpu" else None  # None: CUDA's, kept or measured
    data = _read(settings.speeds_file)
    cpu_key, link_key = _cpu_key(host), _link_key(settings)
    kept_cpu = data.get("cpu", {}).get(cpu_key)
    kept_link = link if link is not None else data.get("link", {}).get(link_key)
    measured = remeasure or kept_cpu is None or kept_link is None
    if remeasure or kept_cpu is None:
        kept_cpu = measure_cpu(host, n_expert_used)
        data.setdefault("cpu", {})[cpu_key] = kept_cpu
    if link is None and (remeasure or kept_link is None):
        kept_link = link_gbps(settings)
        data.setdefault("link", {})[link_key] = kept_link
    if measured:
        _write(settings.speeds_file, data)
    return Speeds(float(kept_link or 0.0), float(kept_cpu), measured)


def resolve(settings: CacheSettings, host: HostExperts, n_expert_used: int) -> tuple[CacheSettings, Speeds | None]:
    """The settings with an auto share replaced by the closed form's (and the speeds it came from), or as
    they are. No cache: no share."""
    if settings.cpu_share != AUTO_SHARE:
        return settings, None
    if settings.mib <= 0 or not host.layers:
        return replace(settings, cpu_share=0.0), None
    s = speeds(settings, host, n_expert_used)
    return replace(settings, cpu_share=s.share), s
