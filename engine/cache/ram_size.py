"""How much RAM the experts get: all of them when they fit, else a RAM tier of what is left (cache.ram_tier).

`--ram-cache-mib auto` (the default) sizes the tier from the memory available at load: the usable
memory is `USABLE` of MemAvailable less `RUNTIME` for the process itself (Python, torch, the
compiled kernels, activations), and the tier gets what the dense weights, the KV cache and one
layer's scratch bank leave of it. `--emulate-host-mib N` makes N MiB the usable memory, exactly,
so that a small model uses the tier in tests and benches on any machine. A number is the tier's
size as given; 0 turns the tier off (the experts are read through the file's map, as the page cache
allows). A model whose dense part and KV cache alone do not fit gets one line saying what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ParameterError
from ..gguf.reader import GGUFFile, block_index
from ..nn.layers import kv_cache_bytes, recurrent_state_bytes
from .auto_size import EXPERT_TENSOR, expert_bytes
from .device_memory import device_free_bytes
from .settings import AUTO_MIB

USABLE = 0.85  # of MemAvailable: the page cache the dense part's map needs, and other processes' growth
RUNTIME = 1 << 30  # bytes the process needs besides the model: the interpreter, torch, the kernels, activations


def expert_tensors(gguf: GGUFFile, layers: range | None = None) -> list[str]:
    """The names of the routed experts' stacked tensors (of `layers` only, where given)."""
    return [n for n in gguf.tensors if EXPERT_TENSOR.match(n) and (layers is None or block_index(n) in layers)]


def size(n: int) -> str:
    """Bytes as a user reads them: GiB from 1 GiB on, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class RamFit:
    """What the RAM holds of a model: bytes of each part, and the tier's size (0: every expert resident)."""

    usable: int
    dense: int  # every tensor but the routed experts' (of a stage: its own layers')
    kv: int
    experts: int
    scratch: int  # one layer's experts: with a tier, a lookup around it reads its misses there
    tier: int  # bytes of expert slots; 0 where the experts are read through the map
    source: str

    @property
    def fraction(self) -> float:
        return self.tier / self.experts if self.experts else 1.0

    def line(self) -> str:
        head = (f"RAM ({self.source}): {size(self.usable)} usable; dense weights {size(self.dense)}, "
                f"KV cache {size(self.kv)}, experts {size(self.experts)}")  # fmt: skip
        if not self.tier:
            return head + ": all in RAM"
        return head + (f": a RAM tier of {size(self.tier)} ({100 * self.fraction:.0f}% of the experts), "
                       f"the rest read from the file as used")  # fmt: skip


def plan(gguf: GGUFFile, cfg: ModelConfig, n_ctx: int, ram_cache_mib: float, emulate_host_mib: float = 0.0,
         layers: range | None = None) -> RamFit:  # fmt: skip
    """The RAM's plan for this model (`layers`: a split model's stage). Raises ParameterError (the setting
    `ram_cache_mib`) where even the dense part cannot fit, or where the asked size holds too few experts."""
    if not (ram_cache_mib >= 0 or ram_cache_mib == AUTO_MIB):
        raise ParameterError("ram_cache_mib", f"the RAM tier's size must be >= 0 MiB or auto, got {ram_cache_mib}")
    if emulate_host_mib < 0:
        raise ParameterError("emulate_host_mib", f"the emulated host memory must be >= 0 MiB, got {emulate_host_mib}")
    # Every expert tensor of the file (of the stage), a trailing NextN block's too: they are not loaded, so
    # this overstates what the experts need, on the safe side.
    experts, per_expert = expert_bytes(gguf, layers=layers)
    own = gguf.tensors if layers is None else gguf.layer_tensors(layers)
    dense = sum(gguf.tensors[n].n_bytes for n in own) - experts
    scratch = max(per_expert.values(), default=0) * cfg.n_expert  # one layer's experts
    kv = kv_cache_bytes(cfg, n_ctx) + recurrent_state_bytes(cfg)
    if emulate_host_mib > 0:
        usable, source = int(emulate_host_mib * 2**20), "--emulate-host-mib"
    else:
        usable, source = max(0, int(USABLE * device_free_bytes(torch.device("cpu"))) - RUNTIME), "available"
    if not experts or ram_cache_mib == 0:
        return RamFit(usable, dense, kv, experts, scratch, 0, source)
    if ram_cache_mib > 0:
        tier = int(ram_cache_mib * 2**20)
        return RamFit(usable, dense, kv, experts, scratch, tier if tier < experts else 0, "--ram-cache-mib")
    if dense + kv + experts <= usable:
        return RamFit(usable, dense, kv, experts, scratch, 0, source)
    left = usable - dense - kv - scratch
    # The least a tier can work with: one token's experts in one layer.
    least = cfg.n_expert_used * max(per_expert.values(), default=0)
    if left < least:
        raise ParameterError(
            "ram_cache_mib",
            f"the model does not fit: its dense weights ({size(dense)}), KV cache ({size(kv)}) and one layer of "
            f"experts ({size(scratch)}) need more than the {size(usable)} usable ({source}); try a smaller quant "
            "of the model, a smaller context (-c), or split it over hosts (torchrun, docs/usage.md)",
        )  # fmt: skip
    return RamFit(usable, dense, kv, experts, scratch, left, source)
