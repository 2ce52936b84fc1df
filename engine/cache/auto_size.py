"""`--moe-cache-mib auto`: the expert cache sized from the device's memory the rest of the model leaves.

The device holds the dense weights (as the file's types), the KV cache at the chosen context, a
prompt's activations and the expert slots; the host keeps every expert. Auto gives the slots what
is left, less a margin, and never more than all the experts:

    cache = min(experts, (memory - dense - KV - activations) * (1 - MARGIN) - reserve)

- memory: CUDA's free memory once the dense weights are there, plus theirs; on the CPU device `--emulate-device-mib`
  (so that the whole path runs, and is tested, without a GPU);
- activations: a prompt of up to PROMPT_ROWS tokens in float32: its hidden states and attention
  inputs (4 x hidden), its widest FFN intermediate (3 x the dense FFN or k experts' width), logits;
- MARGIN of what is left stays free (the allocator's rounding, buffers not counted above), and on
  CUDA also CUDA_RESERVE_MIB for the libraries' workspaces, allocated at their first use.

A stage of a model split over hosts counts what it holds: its own layers' weights, KV cache and
experts, and from layer 0 the embedding and head (each host sizes its own cache).

On the CPU device without an emulated memory the experts are in the device's memory already: auto
means no cache there, and says so (`Fit.note`). With an emulated device memory, a cache larger than
the memory left (before the margin) is refused as CUDA's allocator would refuse it (`check_room`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from ..config import ModelConfig
from ..gguf.reader import GGUFFile
from ..nn.layers import kv_cache_bytes, recurrent_state_bytes
from .settings import AUTO_MIB, CacheError, CacheSettings

MARGIN = 0.03
CUDA_RESERVE_MIB = 256.0
PROMPT_ROWS = 512
MIB = 2**20

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")


def expert_bytes(gguf: GGUFFile, n_layers: int | None = None,
                 layers: range | None = None) -> tuple[int, dict[int, int]]:  # fmt: skip
    """Total bytes of expert weights, and bytes of one expert per layer, over the first `n_layers`
    layers (the ones decoding runs: not a file's trailing NextN blocks), and of those `layers` only
    (a stage of a split model) where given."""
    total = 0
    per_layer: dict[int, int] = defaultdict(int)
    for t in gguf.tensors.values():
        m = EXPERT_TENSOR.match(t.name)
        layer = int(m.group(1)) if m else -1
        if m and (n_layers is None or layer < n_layers) and (layers is None or layer in layers):
            total += t.n_bytes
            per_layer[layer] += t.n_bytes // t.shape[0]
    return total, dict(per_layer)


def activation_bytes(cfg: ModelConfig, n_ctx: int) -> int:
    """A prompt's activations on the device (see the module's doc)."""
    rows = min(n_ctx, PROMPT_ROWS)
    widest = max(cfg.n_ff, cfg.n_expert_used * cfg.n_ff_exp)
    return rows * 4 * (4 * cfg.n_embd + 3 * widest) + 4 * cfg.n_vocab


@dataclass(frozen=True)
class Fit:
    """Where a model's parts go and the cache auto gives it, in MiB."""

    device: str
    memory: float  # the device's memory for this model (0: the CPU device, not emulated)
    emulated: bool
    dense: float
    kv: float
    activations: float
    experts: float
    room: float  # what the slots may take: memory - dense - KV - activations (the largest cache that loads)
    margin: float  # kept free of that room
    cache: float  # what auto gives the cache
    note: str  # in words: why the cache is what it is

    def lines(self) -> list[str]:
        if not self.memory:
            return [f"expert cache (auto): off: {self.note}"]
        kind = "emulated" if self.emulated else "free"
        return [
            f"device: {self.device}, {self.memory:,.0f} MiB {kind}",
            f"dense weights {self.dense:,.1f} MiB, KV cache {self.kv:,.1f} MiB, "
            f"activations {self.activations:,.1f} MiB",
            f"room for expert slots {self.room:,.1f} MiB; margin {self.margin:,.1f} MiB ({MARGIN:.0%} of it"
            f"{f' + {CUDA_RESERVE_MIB:g} MiB for CUDA libraries' if self.device == 'cuda' else ''})",
            f"expert cache (auto): {self.cache:,.1f} MiB of {self.experts:,.1f} MiB of experts "
            f"({self.cache / self.experts:.0%}): {self.note}"
            if self.experts
            else "no routed experts",
        ]


def fit(gguf: GGUFFile, cfg: ModelConfig, n_ctx: int, settings: CacheSettings, free_mib: float | None = None,
        layers: range | None = None) -> Fit:  # fmt: skip
    """The parts of the model at `gguf` on the cache's device and the size auto gives the cache. On CUDA the
    dense weights are there already: `free_mib` is the memory free after them (None: ask the device now).
    `layers`: a split model's stage, which holds its own layers' weights, KV cache and experts (and, from
    layer 0, the embedding and head) in its host's memory."""
    experts, _ = expert_bytes(gguf, cfg.n_layers, layers)
    names = gguf.layer_tensors(layers) if layers is not None else gguf.tensors.keys()
    dense = sum(gguf.tensors[n].n_bytes for n in names) - experts
    kv = kv_cache_bytes(cfg, n_ctx) + recurrent_state_bytes(cfg)
    if layers is not None:  # the stage's share of the layers' caches
        kv = kv * len(range(cfg.n_layers)[layers.start : layers.stop]) // cfg.n_layers
    act = activation_bytes(cfg, n_ctx)
    parts = (dense / MIB, kv / MIB, act / MIB, experts / MIB)
    if settings.device == "cpu" and not settings.emulate_device_mib:
        note = ("the CPU device holds every expert already; an emulated device memory (--emulate-device-mib) "
                "sizes a cache as a GPU's would")  # fmt: skip
        return Fit("cpu", 0.0, False, *parts[:3], parts[3], 0.0, 0.0, 0.0, note)
    emulated = settings.device == "cpu"
    if emulated:
        memory = settings.emulate_device_mib
        room = max(0.0, memory - parts[0] - parts[1] - parts[2])
    else:  # the dense weights are on the device already: its free memory is after them
        if free_mib is None:
            import torch

            from .device_memory import device_free_bytes

            free_mib = device_free_bytes(torch.device(settings.device)) / MIB
        memory = free_mib + parts[0]
        room = max(0.0, free_mib - parts[1] - parts[2])
    reserve = 0.0 if emulated else CUDA_RESERVE_MIB
    margin = min(room, room * MARGIN + reserve)
    cache = min(parts[3], room - margin)
    if parts[3] and cache >= parts[3]:
        note = "every expert fits"
    elif cache > 0:
        note = "the memory left after the dense weights, the KV cache and the activations, less the margin"
    else:
        note = "no memory is left for expert slots: lower the context (-c) or use a device with more memory"
    return Fit(settings.device, memory, emulated, *parts[:3], parts[3], room, margin, cache, note)


def resolve(gguf: GGUFFile, cfg: ModelConfig, n_ctx: int, settings: CacheSettings, free_mib: float | None = None,
            layers: range | None = None) -> tuple[CacheSettings, Fit | None]:  # fmt: skip
    """The settings with auto replaced by its size (and the fit it came from), or as they are; an explicit size
    on an emulated device memory is checked against the room there (`check_room`). `layers`: see `fit`."""
    from dataclasses import replace

    if settings.mib == AUTO_MIB:
        f = fit(gguf, cfg, n_ctx, settings, free_mib, layers)
        return replace(settings, mib=f.cache), f
    if settings.emulate_device_mib and settings.mib > 0:
        check_room(settings.mib, fit(gguf, cfg, n_ctx, settings, layers=layers))
    return settings, None


def check_room(mib: float, f: Fit) -> None:
    """Refuse a cache of `mib` that the emulated device memory cannot hold, as CUDA's allocator would."""
    if mib > f.room:
        raise CacheError(
            "mib",
            f"a cache of {mib:g} MiB does not fit the emulated device's {f.memory:g} MiB: "
            f"{f.room:.0f} MiB are left after the dense weights, the KV cache and the activations",
            suggestion=int(f.room),
        )
