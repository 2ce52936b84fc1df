"""What an expert cache is asked to be: its size, CPU share, device, link, trace and warm-start file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ParameterError
from .policy import POLICIES

MAX_BATCH = 32
PREFETCH = ("auto", "off", "next-layer")
AUTO_MIB = -1.0  # `mib` for auto: sized at load from the device's memory (auto_size), never seen by the cache
AUTO_SHARE = -1.0  # `cpu_share` for auto: the closed form over measured speeds at load (share_auto)


class CacheError(ParameterError):
    """A cache setting that cannot work: `parameter` is its CacheSettings field."""


@dataclass(frozen=True)
class CacheSettings:
    mib: float = 0.0  # 0: no cache; AUTO_MIB: sized at load from the device's memory
    cpu_share: float = 0.0  # AUTO_SHARE: from the link's and the CPU's speeds at load
    device: str = "cpu"
    emulate_link_gbps: float = 0.0  # CPU device only: uploads also wait bytes / speed
    emulate_device_mib: float = 0.0  # CPU device only: the device's memory, for auto and the slots' room
    trace: Path | None = None
    max_batch: int = MAX_BATCH
    load_mode: str = "mmap"  # mmap: experts stay in the file map; pinned: copied to pinned memory (CUDA)
    # How the device computes its experts: "auto" (the Triton kernels on CUDA where the types have
    # them), "triton" (also on the CPU device, in Triton's interpreter: tests), "torch" (dequantize
    # each expert, eager ops).
    device_kernels: str = "auto"
    # Warm start (engine/warm_start.py): the file of this model's saved use counts. Read when the
    # cache is made (the hottest experts fill the slots before the first token), written at close.
    warm_start: Path | None = None
    # Where an auto share's measured speeds are kept for the next load on this machine (None: not kept).
    speeds_file: Path | None = None
    # Which misses the slots admit once full (cache_policy.POLICIES): the rest run on the CPU.
    policy: str = "classlru"
    # Look-ahead (PREFETCH): the next MoE layer's router, applied to this layer's FFN input, predicts its
    # experts, and the predicted misses are uploaded while this layer computes. auto: on where a miss
    # waits for a link (a GPU, an emulated link), off on the CPU device without one, where an upload
    # costs nothing and a prediction could only cost time.
    prefetch: str = "auto"

    def validate(self) -> None:
        if not (self.mib >= 0 or self.mib == AUTO_MIB):
            raise CacheError("mib", f"the cache size must be >= 0 MiB or auto, got {self.mib}")
        if not self.emulate_device_mib >= 0:
            raise CacheError(
                "emulate_device_mib", f"the emulated memory must be >= 0 MiB, got {self.emulate_device_mib}"
            )
        if self.emulate_device_mib and self.device != "cpu":
            raise CacheError("emulate_device_mib", "an emulated device memory only applies to the CPU device")
        if not (0.0 <= self.cpu_share <= 1.0 or self.cpu_share == AUTO_SHARE):
            raise CacheError("cpu_share", f"the CPU share must be in [0, 1] or auto, got {self.cpu_share}")
        if not self.emulate_link_gbps >= 0:
            raise CacheError("emulate_link_gbps", f"the emulated link must be >= 0 GB/s, got {self.emulate_link_gbps}")
        if self.emulate_link_gbps and self.device != "cpu":
            raise CacheError("emulate_link_gbps", "an emulated link only applies to the CPU device")
        if self.load_mode not in ("mmap", "pinned"):
            raise CacheError("load_mode", f"the load mode must be mmap or pinned, got '{self.load_mode}'")
        if self.policy not in POLICIES:
            raise CacheError("policy", f"the cache policy must be one of {', '.join(POLICIES)}, got '{self.policy}'")
        if self.prefetch not in PREFETCH:
            raise CacheError("prefetch", f"prefetch must be one of {', '.join(PREFETCH)}, got '{self.prefetch}'")
        if self.device_kernels not in ("auto", "triton", "torch"):
            raise CacheError(
                "device_kernels", f"the device kernels must be auto, triton or torch, got '{self.device_kernels}'"
            )

    @property
    def fetch_ahead(self) -> bool:
        """Whether predicted misses are uploaded ahead (prefetch resolved)."""
        if self.prefetch == "auto":
            return self.device != "cpu" or self.emulate_link_gbps > 0
        return self.prefetch == "next-layer"
