"""Expert matrices repacked for torch's CPU int4 weight-only kernel (opt-in: `--cpu-kernels int4`).

Every type with per-32 integer codes (`quants.code_groups`: Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K,
Q6_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4) keeps its codes exactly. Codes wider than 4 bits are split
into nibble planes, signed digits in base 16 (two for 5- to 8-bit codes, four for Q6_K's 13-bit
scale-times-code); the planes sit side by side along K and the activations are repeated to
match, so one kernel call reads them all. Per group of 32 the
kernel computes (n - 8) * s + z; each plane gets the group's scale (times 16 for the high one)
and its zero, chosen so the integer part stays exact: only the bf16 rounding of scales (and of
mins, for types with one) and of the activations differs from the exact fp32 path. That error
is bounded in tests/test_fast_kernels.py; bench/kernels.py measures the speed.

Not covered: Q2_K (a min per 16 values, and the kernel's smallest group is 32) and float
experts (F16/BF16/F32). Those stay on the exact path.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from gguf import GGMLQuantizationType as Q

from .quants import CODE_GROUP_TYPES, code_groups

GROUP = 32


class Int4Linear:
    """y = x @ W.T for one quantized matrix W [N, K], through torch's int4 kernel."""

    CHUNK = 8192  # rows packed at a time (a multiple of the 64-row blocks the packing works in): the
    # int32 codes of a 262k-row vocabulary at once would take GBs

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType) -> None:
        self.planes = planes_for(qtype)
        packed, sz = [], []
        for start in range(0, raw.shape[0], self.CHUNK):
            p, z = _pack(raw[start : start + self.CHUNK], qtype, self.planes)
            packed.append(p)
            sz.append(z)
        # Rows pack independently, so the pieces side by side are the whole matrix packed.
        self.packed = torch.cat(packed) if len(packed) > 1 else packed[0]
        self.scales_zeros = torch.cat(sz, dim=1) if len(sz) > 1 else sz[0]  # [P*K/32, N, 2]
        self.n = int(self.scales_zeros.shape[1])
        self.k = int(self.scales_zeros.shape[0]) * GROUP // self.planes

    @property
    def nbytes(self) -> int:
        return int(self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.planes > 1:
            xb = xb.repeat(1, self.planes)  # [M, P*K]: each plane sees the same activations
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scales_zeros)
        return y.float()  # [M, N]


# Nibble planes per type, enough for every code it can hold (Q3_K's third is for code 128 only).
MAX_PLANES = {Q.Q4_0: 1, Q.Q4_1: 1, Q.Q4_K: 1, Q.Q3_K: 3, Q.Q6_K: 4}  # the others: 2
UNSIGNED_4BIT = frozenset({Q.Q4_1, Q.Q4_K})
PLANE_BYTES_PER_WEIGHT = 0.5 + 4 / GROUP  # a nibble, plus a bf16 (scale, zero) per group of 32


def planes_for(qtype: GGMLQuantizationType) -> int:
    return MAX_PLANES.get(qtype, 2)


def _pack(raw: torch.Tensor, qtype: GGMLQuantizationType, n_planes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a quantized matrix -> (packed codes [N, P*K/2] uint8, scales and zeros [P*K/32, N, 2] bf16)."""
    q, scale, minv = code_groups(raw, qtype)  # [N, K], [N, K/32] x 2
    s = scale.bfloat16().float()  # rounded first, so multiples of it below stay exact in bf16
    if qtype in UNSIGNED_4BIT:  # codes 0..15 with a min: n = q
        planes = [(q, s, 8 * s - minv)]
    else:
        # Signed digits in base 16: the low planes hold 0..15 (zero 8 s_p, so (n - 8) s_p + z = n s_p),
        # the top plane the signed rest (n = digit + 8, zero 0); the group's min joins plane 0.
        qmin, qmax = int(q.min()), int(q.max())
        if not (-8 * 16 ** (n_planes - 1) <= qmin and qmax < 8 * 16 ** (n_planes - 1)):
            raise ValueError(f"{qtype.name}: codes {qmin}..{qmax} do not fit {n_planes} 4-bit planes")
        planes = []
        for p in range(n_planes):
            sp = s * 16**p
            top = p == n_planes - 1
            digit = (q >> 4 * p) + 8 if top else (q >> 4 * p) & 15
            zero = torch.zeros_like(s) if top else 8 * sp
            planes.append((digit, sp, zero - minv if p == 0 else zero))
    codes = torch.cat([p[0] for p in planes], dim=1).to(torch.int32)  # [N, P*K]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    sz = torch.cat([torch.stack([ps, pz], -1) for _, ps, pz in planes], dim=1)  # [N, P*K/32, 2]
    return packed, sz.transpose(0, 1).contiguous().bfloat16()


def packed_nbytes(qtype: GGMLQuantizationType, n_weights: int) -> int:
    """Upper bound of the bytes an expert matrix of this type takes once packed."""
    return int(planes_for(qtype) * PLANE_BYTES_PER_WEIGHT * n_weights)


def int4_capable(qtype: GGMLQuantizationType, n: int, k: int) -> bool:
    """Whether an [n, k] matrix of this type can be packed (the kernel packs rows in 16s)."""
    return qtype in CODE_GROUP_TYPES and n % 16 == 0 and k % GROUP == 0
