"""A layer's experts as the file stores them: stacked, still quantized, read in place."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..gguf.dequant import dequantize
from ..gguf.reader import GGUFError
from ..gguf.sources import Source


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


@dataclass(frozen=True)
class LayerExperts:
    gate: ExpertTensor
    up: ExpertTensor
    down: ExpertTensor

    @property
    def bytes_per_expert(self) -> int:
        return self.gate.bytes_per_expert + self.up.bytes_per_expert + self.down.bytes_per_expert


def load_layer_experts(source: Source, layer: int) -> LayerExperts:
    def one(kind: str) -> ExpertTensor:
        name = f"blk.{layer}.ffn_{kind}_exps.weight"
        if name not in source.tensors:
            raise GGUFError(f"{source.path}: tensor '{name}' is missing")
        info = source.tensors[name]
        raw = torch.from_numpy(source.tensor_data(name))  # zero-copy view of the map
        bias_name = f"blk.{layer}.ffn_{kind}_exps.bias"
        bias = None
        if bias_name in source.tensors:
            b = source.tensors[bias_name]
            bias = dequantize(source.tensor_data(bias_name), b.qtype).reshape(b.shape)
        return ExpertTensor(raw, info.qtype, bias)

    return LayerExperts(one("gate"), one("up"), one("down"))
