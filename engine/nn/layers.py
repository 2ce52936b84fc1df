"""Pieces shared by the architecture families: norms, rotary embeddings, attention, KV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..gguf.dequant import dequantize
from ..gguf.quant_types import CPU, supports
from ..gguf.reader import GGUFError
from ..kernels.cpu import dequantize_rows
from ..kernels.layer_halves import FEW_ROWS, decode_attention, rms_rows
from .eager import compiled_ok

if TYPE_CHECKING:
    from ..gguf.sources import Source


def load_weight(source: Source, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A dense tensor from the file (or another source), dequantized (used for everything but the experts)."""
    if name not in source.tensors:
        raise GGUFError(f"{source.path}: tensor '{name}' is missing")
    t = source.tensors[name]
    return dequantize(source.tensor_data(name), t.qtype).reshape(t.shape).to(dtype)


class QuantRows:
    """A quantized [rows, cols] matrix looked up row by row (an embedding without a float copy)."""

    def __init__(self, source: Source, name: str) -> None:
        t = source.tensors[name]
        self.raw = torch.from_numpy(source.tensor_data(name))  # [rows, row bytes], a view of the map
        self.qtype = t.qtype
        self.shape = tuple(t.shape)
        self.device = torch.device("cpu")

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu" and supports(self.qtype, CPU):
            # One compiled call (the kernels' decoder gives the dequantizer's bits): the dequantizer's torch
            # ops took 0.2-0.4 ms a token on a Q4_K embedding of 2048 columns.
            raw = self.raw.numpy()[rows.numpy()]  # [T, row bytes]
            return torch.from_numpy(dequantize_rows(raw, self.qtype, self.shape[1]))
        return dequantize(self.raw[rows], self.qtype)  # [T, cols]

    def moved_to(self, device: torch.device) -> QuantRows:
        """The bytes on `device`: a token's row is decoded there (a few small ops per token)."""
        self.raw = self.raw.to(device)
        self.device = device
        return self


def move_tensors(module: torch.nn.Module, device: torch.device) -> None:
    """Move every plain tensor attribute of `module` and its submodules to `device`.

    Weights are plain attributes (not parameters): the experts, which are not, stay put. Quantized
    matrices (anything with `moved_to`) choose their own form on the device.
    """
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor):
                setattr(sub, name, value.to(device))
            elif callable(getattr(value, "moved_to", None)):
                setattr(sub, name, value.moved_to(device))


def host_rows(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a contiguous float32 array for a compiled call (a view when it already is one)."""
    return np.ascontiguousarray(x.detach().numpy(), dtype=np.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # At decode a model calls this a hundred times per token: a few rows on the CPU take one
    # compiled call (about 10 us here, torch's fused op 15 to 50), the rest one torch op.
    if (weight is not None and x.dim() == 2 and x.shape[0] <= FEW_ROWS and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and compiled_ok()):  # fmt: skip
        return torch.from_numpy(rms_rows(host_rows(x), weight.numpy(), eps))
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class Rope:
    """Rotary position embedding tables: `neox` rotates halves, otherwise adjacent pairs."""

    def __init__(
        self, dim: int, theta: float, n_ctx: int, *, neox: bool, cfg: ModelConfig | None = None, truncate: bool = True
    ) -> None:
        self.dim, self.neox = dim, neox
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim/2]
        self.mscale = 1.0
        if cfg is not None and cfg.rope_scaling.kind == "linear":
            inv = inv / cfg.rope_scaling.factor
        elif cfg is not None and cfg.rope_scaling.kind == "yarn":
            inv, self.mscale = _yarn(inv, dim, theta, cfg, truncate)
        pos = torch.arange(n_ctx, dtype=torch.float64)
        ang = torch.outer(pos, inv)  # [n_ctx, dim/2]
        # cos + i sin, one table for both layouts: adjacent pairs are complex numbers as they lie, and
        # one complex product rotates them, with a third of the eager ops of the real form (each op
        # costs more than its work at one token); halves take its real and imaginary parts.
        self.cis = torch.polar(torch.full_like(ang, self.mscale), ang).to(torch.complex64)  # [n_ctx, dim/2]

    def to(self, device: torch.device) -> Rope:
        self.cis = self.cis.to(device)
        return self

    def parts(self) -> np.ndarray:
        """The table as float32 [n_ctx, dim/2, 2] (cos, sin), a view for the compiled decode attention (CPU)."""
        return torch.view_as_real(self.cis).numpy()

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; pos: [T]
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        if self.neox:
            cis = self.cis[pos].unsqueeze(1)  # [T, 1, dim/2]
            cos, sin = cis.real, cis.imag
            a, b = rot[..., : self.dim // 2], rot[..., self.dim // 2 :]
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            pairs = torch.view_as_complex(rot.float().contiguous().view(*rot.shape[:-1], -1, 2))  # [T, H, dim/2]
            out = torch.view_as_real(pairs * self.cis[pos].unsqueeze(1)).flatten(-2)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def _yarn(inv: torch.Tensor, dim: int, theta: float, cfg: ModelConfig, truncate: bool) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, blend between (as in the YaRN paper)."""
    s = cfg.rope_scaling
    orig = s.original_context or cfg.n_ctx_train

    def correction_dim(n_rot: float) -> float:
        return dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.yarn_beta_fast), correction_dim(s.yarn_beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = inv / s.factor * (1 - extrapolate) + inv * extrapolate
    mscale = (0.1 * math.log(s.factor) + 1.0) * s.yarn_attn_factor if s.factor > 1 else 1.0
    if s.yarn_log_mul > 0:  # the file's magnitude goes into the attention's score scale instead (MLA)
        mscale = 1.0
    return inv, mscale


@dataclass
class LayerCache:
    k: torch.Tensor  # [n_ctx, n_kv, head_dim]; no positions in a linear-attention layer
    v: torch.Tensor  # [n_ctx, n_kv, head_dim_v]
    # Linear attention: the conv's last inputs and the recurrent state, both of a fixed size.
    conv: torch.Tensor | None = None  # [conv_kernel - 1, q|k|v channels]
    state: torch.Tensor | None = None  # [v_heads, ssm_state, head_v]
    # host_heads' views, with the tensors they view: built once, not at every layer of every token
    _heads: tuple[Any, ...] = field(default=(), repr=False, compare=False)


def layer_state_bytes(cfg: ModelConfig, i: int, n_ctx: int, itemsize: int = 4) -> int:
    """Bytes layer `i` keeps per sequence: its keys and values for n_ctx positions (full attention),
    or its linear-attention state (conv inputs and recurrent state, whatever the context)."""
    if cfg.is_recurrent(i):
        return ((cfg.ssm_conv_kernel - 1) * _conv_channels(cfg) + cfg.ssm_state * cfg.ssm_inner) * itemsize
    # A latent cache (MLA) stores the value as the front of the key: no bytes of its own.
    per_head = cfg.head_dim + (0 if cfg.kv_lora_rank else cfg.head_dim_v)
    return n_ctx * cfg.n_head_kv[i] * per_head * itemsize


def kv_cache_bytes(cfg: ModelConfig, n_ctx: int, itemsize: int = 4) -> int:
    """Bytes of a KVCache's keys and values for n_ctx positions (fp32 by default), full-attention layers only."""
    return sum(layer_state_bytes(cfg, i, n_ctx, itemsize) for i in range(cfg.n_layers) if not cfg.is_recurrent(i))


def _conv_channels(cfg: ModelConfig) -> int:
    return 2 * cfg.ssm_k_heads * cfg.ssm_state + cfg.ssm_inner


def recurrent_state_bytes(cfg: ModelConfig, itemsize: int = 4) -> int:
    """Bytes of the linear-attention layers' state (conv inputs and recurrent state), whatever the context."""
    return sum(layer_state_bytes(cfg, i, 0, itemsize) for i in range(cfg.n_layers) if cfg.is_recurrent(i))


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros whose pages the OS hands out as they are first written (numpy's calloc), on the CPU where numpy has
    the dtype: torch.zeros writes every byte, and a bank of slots would take all of its memory at once."""
    if device.type == "cpu" and dtype in (torch.float32, torch.float16):
        return torch.from_numpy(np.zeros(shape, np.float32 if dtype == torch.float32 else np.float16))
    return torch.zeros(shape, dtype=dtype, device=device)


class KVBank:
    """Keys and values of `n_slots` sequences for positions 0..n_ctx-1, one block per layer: k [S, Hkv, n_ctx, D]
    (each slot's KV heads head-major, `head_major`), v likewise. A decode step over several sequences reads
    each one's slot from the same arrays (`kernels.layer_halves.AttentionBlockCall.rows`). Recurrent layers
    keep their state per slot. The zeros are the allocator's untouched pages: a slot takes memory as its
    positions are written."""

    def __init__(self, cfg: ModelConfig, n_ctx: int, n_slots: int = 1, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:  # fmt: skip
        self.cfg, self.n_ctx, self.n_slots, self.dtype = cfg, n_ctx, n_slots, dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        for i in range(cfg.n_layers):
            if cfg.is_recurrent(i):
                self.k.append(None)
                self.v.append(None)
                continue
            k = _untouched_zeros((n_slots, cfg.n_head_kv[i], n_ctx, cfg.head_dim), dtype, self.device)
            self.k.append(k)
            # MLA: the value is the latent, the key's first kv_lora_rank numbers
            self.v.append(
                k[..., : cfg.kv_lora_rank]
                if cfg.kv_lora_rank
                else _untouched_zeros((n_slots, cfg.n_head_kv[i], n_ctx, cfg.head_dim_v), dtype, self.device)
            )
        self._host: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def host(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer i's keys and values as the compiled attention reads them (a CPU bank): [S, Hkv, n_ctx, D] each."""
        held = self._host.get(i)
        if held is None:
            k, v = self.k[i], self.v[i]
            if k is None or v is None:
                raise ValueError(f"layer {i} keeps no keys and values")
            held = self._host[i] = (k.numpy(), v.numpy())
        return held

    def layer(self, i: int, slot: int) -> LayerCache:
        """Slot `slot`'s cache of layer i: views of the bank ([n_ctx, Hkv, D]), or a recurrent layer's own state."""
        cfg, k, v = self.cfg, self.k[i], self.v[i]
        if k is None or v is None:
            none = torch.zeros(0, 1, 1, dtype=self.dtype, device=self.device)
            conv = torch.zeros(cfg.ssm_conv_kernel - 1, _conv_channels(cfg), dtype=self.dtype, device=self.device)
            head_v = cfg.ssm_inner // cfg.ssm_v_heads
            state = torch.zeros(cfg.ssm_v_heads, cfg.ssm_state, head_v, dtype=self.dtype, device=self.device)
            return LayerCache(none, none, conv, state)
        return LayerCache(k[slot].transpose(0, 1), v[slot].transpose(0, 1))

    def caches(self) -> list[KVCache]:
        """One KVCache per slot."""
        return [KVCache(self.cfg, self.n_ctx, self.dtype, self.device, bank=self, slot=s) for s in range(self.n_slots)]


def head_major(n_ctx: int, n_kv: int, dim: int, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> torch.Tensor:  # fmt: skip
    """Zeros [n_ctx, n_kv, dim] whose memory holds each KV head's positions together ([n_kv, n_ctx, dim]).

    One token's attention reads a KV head's keys and values position after position: one stream per
    head. Laid out by position first, a head's rows lay n_kv rows apart, and from memory (where the
    weights leave them) the reads took twice as long. Fused attention takes [n_kv, S, dim] too.
    """
    return torch.zeros(n_kv, n_ctx, dim, dtype=dtype, device=device).transpose(0, 1)


def host_heads(layer: LayerCache) -> tuple[np.ndarray, np.ndarray]:
    """A CPU layer cache's keys and values as the compiled attention reads them: [n_kv, n_ctx, dim] each."""
    held = layer._heads
    if not held or held[0] is not layer.k or held[1] is not layer.v:
        held = layer._heads = (layer.k, layer.v, layer.k.transpose(0, 1).numpy(), layer.v.transpose(0, 1).numpy())
    return held[2], held[3]


class KVCache:
    """Keys and values of every layer for positions 0..n_ctx-1: one sequence's, a slot of a bank (`KVBank`; a
    bank of its own by default)."""

    def __init__(
        self, cfg: ModelConfig, n_ctx: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
        *, bank: KVBank | None = None, slot: int = 0,
    ) -> None:  # fmt: skip
        self.n_ctx = n_ctx
        self.device = torch.device(device)
        self.bank = bank if bank is not None else KVBank(cfg, n_ctx, 1, dtype, device)
        self.slot = slot
        self.layers = [self.bank.layer(i, slot) for i in range(cfg.n_layers)]
        self.pos = 0  # tokens stored


def _visible(pos0: int, t: int, start: int, window: int, device: torch.device) -> torch.Tensor:
    """Which cached positions start..pos0+t-1 each of the t new tokens sees: [T, S] booleans."""
    q_pos = torch.arange(pos0, pos0 + t, device=device).unsqueeze(1)  # [T, 1]
    k_pos = torch.arange(start, pos0 + t, device=device).unsqueeze(0)  # [1, S]
    allowed = k_pos <= q_pos
    if window:
        allowed &= q_pos - k_pos < window
    return allowed


def _with_sink_key(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention sinks (a learned logit per query head that takes part in the softmax and has no value)
    as one more key that every query sees: each query gets one more dimension holding its head's sink
    (over the scale), the keys a zero there, the sink key a one there and nothing else, its value zero.
    So the fused attention runs with sinks too. q [T, H, D], k [S, Hkv, D], v [S, Hkv, D], mask [T, S]."""
    t, n_head, _ = q.shape
    n_kv = k.shape[1]
    q = torch.cat([q, (sinks / scale).reshape(1, n_head, 1).expand(t, -1, -1).to(q.dtype)], dim=-1)  # [T, H, D+1]
    sink_key = torch.zeros(1, n_kv, k.shape[-1] + 1, dtype=k.dtype, device=k.device)
    sink_key[..., -1] = 1.0
    k = torch.cat([F.pad(k, (0, 1)), sink_key])  # [S+1, Hkv, D+1]
    # The values get a zero dimension too: with the keys' width torch runs its fused kernel, with
    # another its unfused one (seven times slower here). The caller drops it from the output.
    v = torch.cat([F.pad(v, (0, 1)), v.new_zeros(1, n_kv, v.shape[-1] + 1)])  # [S+1, Hkv, Dv+1]
    if mask is not None:
        mask = F.pad(mask, (0, 1), value=True)  # [T, S+1]
    return q, k, v, mask


def attention(
    q: torch.Tensor,
    layer: LayerCache,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    pos0: int,
    *,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal GQA attention of `q` [T, H, D] over the cache after storing `k_new`/`v_new` [T, Hkv, D]."""
    t = q.shape[0]
    end = pos0 + t
    layer.k[pos0:end] = k_new
    layer.v[pos0:end] = v_new
    start = max(0, pos0 - window + 1) if window else 0
    k, v = layer.k[start:end], layer.v[start:end]  # [S, Hkv, D]
    if not softcap:
        # One fused op: no [H, T, S] scores held, no dozen eager ones per layer. One token sees every
        # cached position from `start` on: no mask.
        mask = None if t == 1 else _visible(pos0, t, start, window, q.device)  # [T, S]
        dv = v.shape[-1]
        if sinks is not None:
            q, k, v, mask = _with_sink_key(q, k, v, mask, sinks, scale)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )  # [1, H, T, Dv]
        return out[0, ..., :dv].transpose(0, 1)  # [T, H, Dv]
    # Query head h reads KV head h // group: the queries grouped by their KV head, so the cached
    # keys and values are read as they lie (copied per query head they were a group's times the cache).
    n_kv = k.shape[1]
    group = q.shape[1] // n_kv
    qg = q.reshape(t, n_kv, group, q.shape[-1])  # [T, Hkv, G, D]
    scores = torch.einsum("tkgd,skd->kgts", qg, k) * scale  # [Hkv, G, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~_visible(pos0, t, start, window, q.device), float("-inf"))
    if sinks is not None:
        # A learned per-head logit that takes part in the softmax but has no value.
        sink = sinks.reshape(n_kv, group, 1, 1).expand(-1, -1, t, 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1)
    return torch.einsum("kgts,skd->tkgd", probs, v).reshape(t, n_kv * group, v.shape[-1])  # [T, H, Dv]


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos0: int,
    layer: LayerCache,
    rope: Rope,
    *,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Rotary on `q` [T, H, D] and `k` [T, Hkv, D] at positions pos0.., then `attention` over the cache after
    storing k and `v` [T, Hkv, Dv] -> [T, H, Dv].

    One token on the CPU in float32 (no soft cap) takes one compiled call for all of it
    (`layer_halves.decode_attention`): at decode the eager ops cost more than their work."""
    t = q.shape[0]
    if t == 1 and not softcap and layer.k.device.type == "cpu" and layer.k.dtype == torch.float32 and compiled_ok():
        sink = None if sinks is None else sinks.numpy()
        a = decode_attention(host_rows(q[0]), host_rows(k[0]), host_rows(v[0]), rope.parts(), rope.neox,
                             *host_heads(layer), pos0, window, scale, sink)  # fmt: skip
        return torch.from_numpy(a).view(1, q.shape[1], v.shape[-1])
    pos = torch.arange(pos0, pos0 + t, device=q.device)
    return attention(rope(q, pos), layer, rope(k, pos), v, pos0, scale=scale, window=window, sinks=sinks,
                     softcap=softcap)  # fmt: skip
