"""Expert matrices repacked for torch's CPU int4 weight-only kernel (opt-in: `--cpu-kernels int4`).

Q4_0 and Q4_K keep their exact 4-bit codes; each group of 32 gets torch's affine map
w = (q - 8) * scale + zero with scale = s and zero = 8 s - m (from w = s q - m). The kernel takes
bf16 activations and bf16 scales, so results differ from the exact fp32 path by bf16 rounding
(bounded in tests/test_fast_kernels.py); it reads the weights at 5 to 6 GB/s here where
dequantize-then-matmul reads 0.05 to 0.15 GB/s (bench/kernels.py). Off by default: it changes
the numbers the model computes.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from .quants import INT4_TYPES, int4_groups

GROUP = 32


class Int4Linear:
    """y = x @ W.T for one quantized matrix W [N, K], through torch's int4 kernel."""

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType) -> None:
        q, scale, minv = int4_groups(raw, qtype)  # [N, K], [N, K/32] x 2
        self.n, self.k = q.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        zero = 8 * scale - minv
        self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()  # [K/32, N, 2]

    @property
    def nbytes(self) -> int:
        return int(self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros)
        return y.float()  # [M, N]


def int4_capable(qtype: GGMLQuantizationType, k: int) -> bool:
    return qtype in INT4_TYPES and k % 256 == 0  # the kernel packs K in tiles
