"""The MoE block, split so that the expert cache can slot in behind one interface.

router -> (ids, weights) per token -> expert execution -> weighted sum (+ shared expert).

`ExpertExecutor` is that interface: given a layer, the hidden states and the selected ids and
weights, it returns the weighted sum of the selected experts' outputs. `HostExperts` reads
the experts straight from the file's quantized bytes and dequantizes only the selected ones,
never the whole layer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .config import GATING_SELECT, GATING_SIGMOID, GATING_SOFTMAX_SELECTED, ModelConfig
from .gguf_file import GGUFError, GGUFFile
from .quants import dequantize

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def route(
    logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (ids [T, k], weights [T, k]) per the family's normalisation."""
    k = cfg.n_expert_used
    if cfg.expert_gating == GATING_SELECT:
        ids = torch.topk(logits, k, dim=-1).indices  # [T, k]
        return ids, torch.ones(ids.shape, dtype=logits.dtype, device=logits.device)
    if cfg.expert_gating == GATING_SIGMOID:
        probs = torch.sigmoid(logits)
    elif cfg.expert_gating == GATING_SOFTMAX_SELECTED:
        probs = logits
    else:
        probs = F.softmax(logits, dim=-1)
    scores = probs + bias if bias is not None else probs
    ids = torch.topk(scores, k, dim=-1).indices  # [T, k]
    weights = probs.gather(-1, ids)
    if cfg.expert_gating == GATING_SOFTMAX_SELECTED:
        weights = F.softmax(weights, dim=-1)
    elif cfg.expert_weights_norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights * cfg.expert_weights_scale


@dataclass(frozen=True)
class ExpertTensor:
    """One layer's stacked expert matrices, still quantized: [n_expert, rows, row_bytes]."""

    raw: torch.Tensor
    qtype: GGMLQuantizationType
    bias: torch.Tensor | None = None  # [n_expert, rows]

    @property
    def bytes_per_expert(self) -> int:
        return int(self.raw[0].numel())

    @property
    def cols(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.raw.shape[-1] // size * block

    def expert(self, e: int) -> torch.Tensor:
        return dequantize(self.raw[e], self.qtype)  # [rows, cols]

    def packed(self, e: int) -> Weight:
        """Expert e through torch's int4 kernel (exact codes, bf16 scales) where its type allows."""
        from .fast_kernels import Int4Linear, int4_capable

        rows = self.raw.shape[1]
        return Int4Linear(self.raw[e], self.qtype) if int4_capable(self.qtype, rows, self.cols) else self.expert(e)

    def packed_nbytes(self) -> int:
        """Bytes of all experts of this tensor once packed (fp32 for the types the kernel does not take)."""
        from .fast_kernels import int4_capable, packed_nbytes

        n_expert, rows = self.raw.shape[0], self.raw.shape[1]
        if int4_capable(self.qtype, rows, self.cols):
            return n_expert * packed_nbytes(self.qtype, rows * self.cols)
        return n_expert * rows * self.cols * 4


@dataclass(frozen=True)
class LayerExperts:
    gate: ExpertTensor
    up: ExpertTensor
    down: ExpertTensor

    @property
    def bytes_per_expert(self) -> int:
        return self.gate.bytes_per_expert + self.up.bytes_per_expert + self.down.bytes_per_expert


def load_layer_experts(gguf: GGUFFile, layer: int) -> LayerExperts:
    def one(kind: str) -> ExpertTensor:
        name = f"blk.{layer}.ffn_{kind}_exps.weight"
        if name not in gguf.tensors:
            raise GGUFError(f"{gguf.path}: tensor '{name}' is missing")
        info = gguf.tensors[name]
        raw = torch.from_numpy(gguf.tensor_data(name))  # zero-copy view of the map
        bias_name = f"blk.{layer}.ffn_{kind}_exps.bias"
        bias = None
        if bias_name in gguf.tensors:
            b = gguf.tensors[bias_name]
            bias = dequantize(gguf.tensor_data(bias_name), b.qtype).reshape(b.shape)
        return ExpertTensor(raw, info.qtype, bias)

    return LayerExperts(one("gate"), one("up"), one("down"))


Weight = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]  # a dense matrix, or a packed one that applies itself


def _linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    y = w(x)
    return y if b is None else y + b


def _nbytes(w: Weight) -> int:
    return int(w.numel() * w.element_size()) if isinstance(w, torch.Tensor) else int(getattr(w, "nbytes", 0))


def expert_ffn(x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: Activation,
               biases: tuple[torch.Tensor | None, ...] = (None, None, None)) -> torch.Tensor:  # fmt: skip
    """One expert on the rows routed to it: x [n, E] -> [n, E]."""
    g = _linear(x, gate, biases[0])
    u = _linear(x, up, biases[1])
    return _linear(act(g, u), down, biases[2])


class ExpertExecutor(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, E], ids/weights [T, k] -> sum over k of weight * expert(x) [T, E]."""
        ...

    def end_of_generation(self) -> None:
        """A generation finished: publish what should be published."""
        ...


Contribution = tuple[int, torch.Tensor, torch.Tensor]  # (expert, token rows, weighted output rows)


Triple = tuple[Weight, Weight, Weight]


class DequantCache:
    """Dequantized (gate, up, down) of recently used experts, least recently used dropped past a byte budget.

    Dequantizing is most of a CPU expert's time (bench/kernels.py: 0.03 to 0.9 GB/s against
    ~15 GB/s of RAM reads); a hot expert kept in fp32 skips it. The values are the exact
    dequantizer's, so results do not change. It costs 4 bytes per weight (7 to 14 times the
    quantized size), which is why it is an explicit option (`--cpu-dequant-mib`), off by default.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self.items: OrderedDict[tuple[int, int], Triple] = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # the CPU-share worker and the main path both use it

    def get(self, key: tuple[int, int], make: Callable[[], Triple]) -> Triple:
        with self._lock:
            got = self.items.get(key)
            if got is not None:
                self.items.move_to_end(key)
                self.hits += 1
                return got
        value = make()
        size = sum(_nbytes(t) for t in value)
        with self._lock:
            self.misses += 1
            if size <= self.budget and key not in self.items:
                self.items[key] = value
                self.used += size
                while self.used > self.budget:
                    _, old = self.items.popitem(last=False)
                    self.used -= sum(_nbytes(t) for t in old)
        return value


class HostExperts:
    """Expert execution straight from the host copy: dequantize each selected expert, run it."""

    def __init__(self, layers: dict[int, LayerExperts], act: Activation) -> None:
        self.layers = layers
        self.act = act
        self.dequant: DequantCache | None = None  # set by the loader when asked for
        self.int4 = False  # --cpu-kernels int4: Q4_0/Q4_K matrices through torch's int4 kernel

    def fetcher(self, layer: int) -> Callable[[int], Triple] | None:
        """How CPU code gets an expert's fp32 matrices: through the dequant cache when there is one."""
        cache = self.dequant
        if cache is None:
            return None
        lx = self.layers[layer]
        if self.int4:
            return lambda e: cache.get((layer, e), lambda: (lx.gate.packed(e), lx.up.packed(e), lx.down.packed(e)))
        return lambda e: cache.get((layer, e), lambda: (lx.gate.expert(e), lx.up.expert(e), lx.down.expert(e)))

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # The experts live in host memory and run there; x may be on a device.
        xh, ih, wh = x.cpu(), ids.cpu(), weights.cpu()
        parts = run_experts(self.layers[layer], xh, ih, wh, self.act, ih.unique().tolist(), fetch=self.fetcher(layer))
        return combine(x, parts)

    def end_of_generation(self) -> None:
        pass  # no statistics to publish


def run_experts(
    lx: LayerExperts,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    act: Activation,
    experts: list[int],
    fetch: Callable[[int], tuple[Weight, Weight, Weight]] | None = None,
) -> list[Contribution]:
    """Weighted outputs of `experts` (a subset of those in `ids`) for the tokens routed to them.

    `fetch(e)` gives the dequantized (gate, up, down) of expert e; by default the host copy.
    `ids` may live on the host while x is on a device: the row lookup then needs no device sync.
    """
    parts: list[Contribution] = []
    # Decode (one token, ids on the host): no row lookups, so no nonzero and no gathers per
    # expert (measurable at 270 experts per token on the demo); the arithmetic is the same.
    row = ids[0].tolist() if x.shape[0] == 1 and ids.device.type == "cpu" else None
    only = torch.zeros(1, dtype=torch.long, device=x.device)
    for e in experts:
        if row is not None:
            j = row.index(e)
            tok, xe, w = only, x, weights[:, j : j + 1]
        else:
            tok, slot = (ids == e).nonzero(as_tuple=True)  # rows routed to e
            if tok.device != x.device:
                tok, slot = tok.to(x.device, non_blocking=True), slot.to(x.device, non_blocking=True)
            xe, w = x[tok], weights[tok, slot].unsqueeze(-1)
        gate, up, down = fetch(e) if fetch is not None else (lx.gate.expert(e), lx.up.expert(e), lx.down.expert(e))
        biases = tuple(t.bias[e] if t.bias is not None else None for t in (lx.gate, lx.up, lx.down))
        parts.append((e, tok, expert_ffn(xe, gate, up, down, act, biases) * w))
    return parts


def combine(x: torch.Tensor, parts: list[Contribution]) -> torch.Tensor:
    """Sum the contributions in expert order, so where each expert ran never changes the result."""
    out = torch.zeros_like(x)
    for _, tok, y in sorted(parts, key=lambda p: p[0]):
        out.index_add_(0, tok.to(out.device), y.to(out.device))
    return out
