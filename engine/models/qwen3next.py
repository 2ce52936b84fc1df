"""Qwen3-Next (qwen3next) and Qwen3.5/3.6 MoE (qwen35moe): hybrid linear/full attention with experts.

Their quirks, all read from the file:
- Three of every four layers (`full_attention_interval`) mix tokens with a Gated DeltaNet: a
  causal depthwise conv (`ssm.conv_kernel` taps) over the q|k|v projection, then per value head a
  [key dim, value dim] state S that each token decays and corrects (the delta rule):
      S <- exp(g) S;  S <- S + k (beta (v - k.S));  out = q.S
  with q and k L2-normed (q also scaled by 1/sqrt(key dim)), beta = sigmoid(x W_beta) and the log
  decay g = ssm_a * softplus(x W_alpha + dt_bias) (the file holds ssm_a = -exp(A_log)). The
  output is RMS-normed per head, gated by SiLU(x W_gate), and projected back. A layer carries the
  conv's last inputs and S from token to token: no KV cache, whatever the context.
- Key heads serve several value heads: Qwen3-Next's files group a key head's value heads together
  (value head j reads key head j // ratio), Qwen3.5's converter tiles them (key head j % n_key).
- Qwen3-Next files hold beta and alpha in one matrix, per key head [beta x ratio, alpha x ratio];
  older ones hold q|k|v|z in one (`ssm_in`), per key head. Both are split at load.
- The other layers: attention whose query projection also yields a per-head output gate
  (per head [query, gate]), sigmoid-applied before the output projection; per-head QK norms;
  rotary embedding on the first quarter of each head, halves rotated. Qwen3.5's multi-axis rotary
  sections all carry the token's position in text, so it is the same rotation.
- Every layer is MoE: softmax routing, renormalised top-k, a shared expert behind a sigmoid gate.
  The pre-FFN norm is named `post_attention_norm`. Qwen3.5's MTP block is neither run nor loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..config import ModelConfig
from ..gguf.reader import GGUFError
from ..gguf.sources import Layout, Source
from ..kernels.layer_halves import delta_rule_rows
from ..nn.activations import swiglu
from ..nn.layers import LayerCache, Rope, host_rows, rms_norm
from ..nn.qlinear import Weight, linear, linears
from ..nn.weights import linear_form, maybe, want
from .decoder import Attention, Family, SelfAttention


class GatedAttention(Attention):
    """Full attention with a sigmoid output gate that the query projection yields per head."""

    def forward(self, h: torch.Tensor, pos0: int, cache: LayerCache, rope: Rope) -> torch.Tensor:
        cfg, t = self.cfg, h.shape[0]
        qg = linear(h, self.wq).view(t, cfg.n_head, 2, cfg.head_dim)  # per head [query, gate]
        q, gate = qg[:, :, 0].reshape(t, -1), qg[:, :, 1].reshape(t, -1)  # [T, H*D] each
        k, v = linears(h, (self.wk, self.wv), (None, None))
        a = self.attend(q, k, v, pos0, cache, rope).reshape(t, -1)  # [T, H*Dv]
        return linear(a * torch.sigmoid(gate), self.wo)


class GatedDeltaNet(nn.Module):
    def __init__(self, layout: Layout, cfg: ModelConfig, i: int, quantized: bool, tiled_heads: bool) -> None:
        super().__init__()
        p, form = f"blk.{i}.", linear_form(quantized)
        hk, hv, dk = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state
        dv = cfg.ssm_inner // hv
        self.cfg, self.dims = cfg, (hk, hv, dk, dv)
        self.w_qkv: Weight
        self.w_z: Weight
        # Joint tensors of older files (q|k|v|z, beta|alpha per key head) are split by on_load.
        self.w_qkvz = maybe(layout, p + "ssm_in.weight") if p + "attn_qkv.weight" not in layout.tensors else None
        if self.w_qkvz is None:
            self.w_qkv = want(layout, p + "attn_qkv.weight", form)  # [2*Hk*Dk + Hv*Dv, E]
            self.w_z = want(layout, p + "attn_gate.weight", form)  # [Hv*Dv, E]
        self.ba = maybe(layout, p + "ssm_ba.weight")
        self.beta: Any = want(layout, p + "ssm_beta.weight") if self.ba is None else None
        self.alpha: Any = want(layout, p + "ssm_alpha.weight") if self.ba is None else None
        self.conv = want(layout, p + "ssm_conv1d.weight")  # [C, taps]
        channels, shape = 2 * hk * dk + hv * dv, layout.tensors[p + "ssm_conv1d.weight"].shape
        if tuple(shape) != (channels, cfg.ssm_conv_kernel):
            raise GGUFError(f"{layout.path}: tensor '{p}ssm_conv1d.weight': shape {tuple(shape)}, expected "
                            f"{(channels, cfg.ssm_conv_kernel)} from the ssm.* keys")  # fmt: skip
        self.dt_bias = want(layout, p + "ssm_dt.bias")  # [Hv]
        self.a = want(layout, p + "ssm_a")  # [Hv]: -exp(A_log)
        self.norm = want(layout, p + "ssm_norm.weight")  # [Dv]
        self.w_out = want(layout, p + "ssm_out.weight", form)  # [E, Hv*Dv]
        heads = torch.arange(hv)
        self.key_head = heads % hk if tiled_heads else heads // (hv // hk)  # [Hv]: the key head each value head reads

    def on_load(self, source: Source) -> None:
        (hk, hv, dk, dv), e = self.dims, self.cfg.n_embd
        r = hv // hk
        if self.w_qkvz is not None:  # per key head [q, k, v x ratio, z x ratio]
            q, k, v, z = self.w_qkvz.view(hk, 2 * dk + 2 * r * dv, e).split([dk, dk, r * dv, r * dv], dim=1)
            self.w_qkv = torch.cat([q.reshape(-1, e), k.reshape(-1, e), v.reshape(-1, e)])
            self.w_z = z.reshape(-1, e).contiguous()
            self.w_qkvz = None
        if self.ba is not None:  # per key head [beta x ratio, alpha x ratio]
            ba = self.ba.view(hk, 2 * r, e)
            self.beta, self.alpha = ba[:, :r].reshape(hv, e), ba[:, r:].reshape(hv, e)
        self.w_ba = torch.cat([self.beta, self.alpha])  # [2*Hv, E]: both in one matmul
        self.ba = self.beta = self.alpha = None

    def forward(self, h: torch.Tensor, pos0: int, cache: LayerCache, rope: Rope) -> torch.Tensor:
        (hk, hv, dk, dv), t = self.dims, h.shape[0]
        assert cache.conv is not None and cache.state is not None  # a recurrent layer's cache has both
        qkv, z = linears(h, (self.w_qkv, self.w_z), (None, None))  # [T, C], [T, Hv*Dv]
        b, a = F.linear(h, self.w_ba).split(hv, dim=-1)  # [T, Hv] each
        beta = torch.sigmoid(b)
        decay = torch.exp(self.a * F.softplus(a + self.dt_bias))
        x = torch.cat([cache.conv, qkv])  # [taps - 1 + T, C]: the earlier tokens' inputs first
        taps = self.conv.shape[1]
        mixed = x[:t] * self.conv[:, 0]
        for j in range(1, taps):
            mixed = mixed + x[j : j + t] * self.conv[:, j]
        mixed = F.silu(mixed)  # [T, C]
        cache.conv.copy_(x[t:])
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = F.normalize(q.view(t, hk, dk), dim=-1, eps=self.cfg.norm_eps)[:, self.key_head] * dk**-0.5  # [T, Hv, Dk]
        k = F.normalize(k.view(t, hk, dk), dim=-1, eps=self.cfg.norm_eps)[:, self.key_head]
        v = v.view(t, hv, dv)
        out = delta_rule(q, k, v, decay, beta, cache.state)  # [T, Hv, Dv]
        out = rms_norm(out, self.norm, self.cfg.norm_eps) * F.silu(z.view(t, hv, dv))
        return linear(out.reshape(t, -1), self.w_out)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The gated delta rule token by token: q, k [T, H, Dk], v [T, H, Dv], decay, beta [T, H];
    `state` [H, Dk, Dv] is read and left holding the state after the last token. -> [T, H, Dv].

    On the CPU in float32 one compiled call runs it (`kernels.layer_halves.delta_rule_rows`); the torch loop
    below is the reference the tests hold it to, and the form every other device runs."""
    if state.device.type == "cpu" and state.dtype == torch.float32 and state.is_contiguous():
        qr, kr, vr, dr, br = (host_rows(x) for x in (q, k, v, decay, beta))
        return torch.from_numpy(delta_rule_rows(qr, kr, vr, dr, br, state.numpy()))
    return delta_rule_torch(q, k, v, decay, beta, state)


def delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:  # fmt: skip
    s = state
    out = torch.empty_like(v)
    for i in range(q.shape[0]):
        s = s * decay[i, :, None, None]
        error = (v[i] - torch.einsum("hk,hkv->hv", k[i], s)) * beta[i, :, None]  # [H, Dv]
        s = s + k[i, :, :, None] * error[:, None, :]
        out[i] = torch.einsum("hk,hkv->hv", q[i], s)
    state.copy_(s)
    return out


def _grouped(layout: Layout, cfg: ModelConfig, i: int, quantized: bool) -> SelfAttention:
    if cfg.is_recurrent(i):
        return GatedDeltaNet(layout, cfg, i, quantized, tiled_heads=False)
    return GatedAttention(layout, cfg, i, quantized)


def _tiled(layout: Layout, cfg: ModelConfig, i: int, quantized: bool) -> SelfAttention:
    if cfg.is_recurrent(i):
        return GatedDeltaNet(layout, cfg, i, quantized, tiled_heads=True)
    return GatedAttention(layout, cfg, i, quantized)


_RENORMALISED = {"expert_weights_norm": True}  # the routers renormalise the top-k weights; no key says so
FAMILY = Family(neox_rope=True, act=swiglu, ffn_norm="post_attention_norm", attention=_grouped, metadata=_RENORMALISED)
FAMILY_35 = Family(neox_rope=True, act=swiglu, ffn_norm="post_attention_norm", attention=_tiled,
                   metadata=_RENORMALISED)  # fmt: skip
