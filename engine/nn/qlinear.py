"""Dense matrices kept as the file's quantized bytes and applied with the CPU kernels.

`QLinear` is what a model holds for a quantized matrix it runs on the CPU (attention
projections, shared experts, dense FFNs, the output head): no float copy is ever made. A few
tokens (decode) go through `cpu_kernels.dense`, which reads each row once for all of them; many
(prefill) too where its integer tiles read the type, else a float GEMM over the matrix decoded a
tile of rows at a time.
`linear` applies either kind of weight. A matrix's `bits` is what its activations are rounded to in
the kernels for a few tokens (decode), `prompt_bits` for many: see `kernels.isa.activation_bits`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..gguf.dequant import dequantize
from ..gguf.quant_types import CPU, supports
from ..kernels import cpu as cpu_kernels
from ..kernels import device as device_kernels
from ..kernels.codes import GEMM_TOKENS
from ..kernels.layer_halves import FEW_ROWS, FfnBlockCall
from ..kernels.qtiles import TILE_TOKENS
from .activations import activation_code
from .layers import host_rows

GEMM_TILE_BYTES = 16 << 20  # float32 bytes of one decoded tile


class QLinear:
    """y = x @ W.T for a quantized matrix W [N, K] read from its bytes [N, row_bytes]."""

    def __init__(self, raw: np.ndarray, qtype: GGMLQuantizationType, bits: int = 16, prompt_bits: int = 16) -> None:
        if not supports(qtype, CPU):
            raise ValueError(f"no CPU kernel for {qtype.name}")
        block, size = GGML_QUANT_SIZES[qtype]
        self.raw = np.ascontiguousarray(raw)  # a view of the file's map: no copy
        self.qtype = qtype
        self.bits = bits  # a few tokens' activations (decode)
        self.prompt_bits = prompt_bits  # GEMM_TOKENS or more
        self.shape = (int(raw.shape[0]), int(raw.shape[1]) // size * block)
        self.device = torch.device("cpu")

    @property
    def tiled(self) -> bool:
        """Whether a prompt multiplies in the kernels' integer tiles (they read the type; faster than
        decoding to float for sgemm), else by a float GEMM over decoded tiles of rows. Asked at each
        call: `set_activation_bits` changes the bits after loading."""
        return cpu_kernels.tiles_read(self.qtype, self.shape[1], self.prompt_bits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        if x.shape[0] < GEMM_TOKENS:
            return torch.from_numpy(cpu_kernels.dense(self.raw, self.qtype, x.numpy(), self.bits))
        if self.tiled:
            return torch.from_numpy(cpu_kernels.dense(self.raw, self.qtype, x.numpy(), self.prompt_bits))
        return self.gemm(x)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] (float32, contiguous) @ W.T by torch's float GEMM over tiles of rows decoded in parallel."""
        n, k = self.shape
        tile = max(1, GEMM_TILE_BYTES // (4 * k))
        out = torch.empty(x.shape[0], n)
        for r in range(0, n, tile):
            w = torch.from_numpy(cpu_kernels.dequantize_rows(self.raw[r : r + tile], self.qtype, k))
            out[:, r : r + tile] = F.linear(x, w)
        return out

    def dequantized(self) -> torch.Tensor:
        """The whole matrix in float32, as the exact dequantizer gives it."""
        return dequantize(self.raw, self.qtype)

    def moved_to(self, device: torch.device) -> Weight:
        """This matrix for a model on `device`: on a GPU the file's bytes under the device kernels when
        they read the type (a quarter to a half of bf16's bytes, read per token), else float32."""
        if device.type == "cpu":
            return self
        if device_kernels.supports((self.qtype,)):
            return DeviceQLinear(torch.from_numpy(self.raw).to(device), self.qtype, self.shape)
        return self.dequantized().to(device)


class DeviceQLinear:
    """y = x @ W.T for a quantized matrix whose bytes [N, row_bytes] are on the device (device_kernels)."""

    def __init__(self, raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> None:
        self.raw = raw
        self.qtype = qtype
        self.shape = shape
        self.device = raw.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return device_kernels.dense(self.raw, self.qtype, x.float().contiguous())

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.raw, self.qtype)


Weight = torch.Tensor | QLinear | DeviceQLinear


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    y = w(x)
    return y if b is None else y + b


def linear_rows(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` on a decode step's rows (up to FEW_ROWS tokens of as many sequences), each the bits it gets alone: a
    float matrix one row at a time (torch's product takes another path for one row than for several), a
    quantized one in groups below the int8 tiles (VNNI's tiles sum in another order than a token alone); the
    kernels' other few-token products are the same bits for one token as among others."""
    if isinstance(w, torch.Tensor):
        group = 1
    elif isinstance(w, QLinear) and w.bits == 8 and cpu_kernels.tiles_read(w.qtype, w.shape[1], 8):
        group = TILE_TOKENS - 1
    else:
        return linear(x, w, b)
    if x.shape[0] <= group or x.shape[0] > FEW_ROWS:  # (a prompt's rows: one product)
        return linear(x, w, b)
    return torch.cat([linear(x[t : t + group], w, b) for t in range(0, x.shape[0], group)])


def linears(x: torch.Tensor, ws: tuple[Weight, ...], bs: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
    """x @ w.T + b for each of several matrices of one input (a layer's q, k and v): in one kernel
    call when they are all quantized with one type and few tokens run, else one at a time."""
    qs = [w for w in ws if isinstance(w, QLinear)]
    same = all((w.qtype, w.bits) == (qs[0].qtype, qs[0].bits) for w in qs)
    if x.shape[0] < GEMM_TOKENS and len(qs) == len(ws) and same:
        xs = x.float().contiguous().numpy()
        outs = cpu_kernels.dense_many(tuple(w.raw for w in qs), qs[0].qtype, xs, qs[0].bits)
        return [torch.from_numpy(y) if b is None else torch.from_numpy(y) + b for y, b in zip(outs, bs, strict=True)]
    return [linear(x, w, b) for w, b in zip(ws, bs, strict=True)]


Act = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gated(x: torch.Tensor, gate: Weight, up: Weight, act: Act) -> torch.Tensor:
    """act(x @ gate.T, x @ up.T): a gated FFN's first half, in one kernel call when it can be."""
    code = activation_code(act)
    if (isinstance(gate, QLinear) and isinstance(up, QLinear) and code is not None and x.shape[0] < GEMM_TOKENS
            and gate.shape == up.shape and gate.bits == up.bits):  # fmt: skip
        xs = x.float().contiguous().numpy()
        out = np.empty((xs.shape[0], gate.shape[0]), np.float32)
        one, ptr, rows = cpu_kernels.one_matrix(xs.shape[0])
        cpu_kernels.gate_up(gate.raw[None], gate.qtype, up.raw[None], up.qtype, xs, rows, one, one, ptr, rows, rows,
                            out, code, bits=gate.bits)  # fmt: skip
        return torch.from_numpy(out)
    return act(linear(x, gate), linear(x, up))


def ffn_call(
    gate: Weight, up: Weight, down: Weight, act: Act, *, norm: torch.Tensor | None = None, eps: float = 0.0,
    post_norm: torch.Tensor | None = None, residual: bool = False,
) -> FfnBlockCall | None:  # fmt: skip
    """One token's gated FFN over these matrices bound as one compiled call (`layer_halves.FfnBlockCall`: x (+ if
    residual) post_norm(down @ act(gate @ h, up @ h)), h = rms_norm(x) or x); None where there is none: float
    matrices, other shapes or widths, an activation without a compiled form."""
    code = activation_code(act)
    if code is None or not (isinstance(gate, QLinear) and isinstance(up, QLinear) and isinstance(down, QLinear)
                            and gate.shape == up.shape and gate.bits == up.bits == down.bits):  # fmt: skip
        return None
    ws = ((gate.raw, gate.qtype), (up.raw, up.qtype), (down.raw, down.qtype))
    return FfnBlockCall(None if norm is None else norm.numpy(), eps, ws, code,
                        None if post_norm is None else post_norm.numpy(), residual, gate.bits)  # fmt: skip


def ffn(x: torch.Tensor, gate: Weight, up: Weight, down: Weight, act: Act) -> torch.Tensor:
    """down @ act(gate @ x, up @ x) for x [T, E]: one compiled call for a few tokens where it can be (each the
    bits it gets alone)."""
    call = ffn_call(gate, up, down, act) if x.shape[0] <= FEW_ROWS else None
    if call is not None:
        return torch.from_numpy(call(host_rows(x)))
    return linear(gated(x, gate, up, act), down)


def set_activation_bits(model: torch.nn.Module, bits: int, prompt_bits: int) -> None:
    """Every quantized matrix of a model rounds its activations to `bits` (8 or 16) in the kernels
    for a few tokens, to `prompt_bits` for a prompt."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, QLinear):
                value.bits, value.prompt_bits = bits, prompt_bits
