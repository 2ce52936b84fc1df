"""One registry entry per GGUF quant type: its block (weights and bytes) and the paths that decode it.

Each path implements its own decoding (the torch dequantizer in `dequant`, the CPU kernels'
vector code in `kernels.qblocks`, the Triton decoder in `kernels.device`), and each of them builds
its table of types from this one: a type is claimed here, and a path lacking its implementation
fails at import. A test checks every claimed path against gguf-py's reference dequantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

TORCH = "torch"  # gguf.dequant: float32 on any torch device, bit-exact with gguf-py
CPU = "cpu"  # kernels.qblocks: the numba kernels read the blocks in place
DEVICE = "device"  # kernels.device: the Triton kernels read the blocks in place
PATHS = (TORCH, CPU, DEVICE)


@dataclass(frozen=True)
class QuantType:
    qtype: GGMLQuantizationType
    paths: frozenset[str]

    @property
    def block_weights(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]


def _entry(qtype: GGMLQuantizationType, *paths: str) -> tuple[GGMLQuantizationType, QuantType]:
    return qtype, QuantType(qtype, frozenset(paths))


REGISTRY: dict[GGMLQuantizationType, QuantType] = dict(
    (
        _entry(Q.F32, TORCH),
        _entry(Q.F16, TORCH),
        _entry(Q.BF16, TORCH),
        _entry(Q.Q4_0, TORCH, CPU, DEVICE),
        _entry(Q.Q4_1, TORCH, CPU),
        _entry(Q.Q5_0, TORCH, CPU),
        _entry(Q.Q5_1, TORCH, CPU),
        _entry(Q.Q8_0, TORCH, CPU, DEVICE),
        _entry(Q.Q2_K, TORCH),
        _entry(Q.Q3_K, TORCH),
        _entry(Q.Q4_K, TORCH, CPU, DEVICE),
        _entry(Q.Q5_K, TORCH, CPU, DEVICE),
        _entry(Q.Q6_K, TORCH, CPU, DEVICE),
        _entry(Q.IQ4_NL, TORCH, CPU),
        _entry(Q.IQ4_XS, TORCH, CPU, DEVICE),
        _entry(Q.MXFP4, TORCH, CPU, DEVICE),
    )
)


def types_for(path: str) -> frozenset[GGMLQuantizationType]:
    """The types `path` decodes."""
    return frozenset(t for t, e in REGISTRY.items() if path in e.paths)


def supports(qtype: GGMLQuantizationType, path: str) -> bool:
    entry = REGISTRY.get(qtype)
    return entry is not None and path in entry.paths
