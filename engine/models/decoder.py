"""The decoder every supported family shares; a family module picks its rope, activation and quirks.

Features are switched on by what the file holds (biases, QK norms, sinks, shared experts,
router bias) and by the config (sliding-window layers, gating), never by the model's name.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.nn import functional as F

from ..config import ModelConfig
from ..gguf.sources import Layout, Source
from ..kernels.layer_halves import FEW_ROWS, AttentionBlockCall, decode_attention, route_rows
from ..kernels.moe_token import MoeTokenCall
from ..moe.expert_tensors import load_layer_experts
from ..moe.host_experts import ExpertExecutor, HostExperts
from ..moe.routing import route
from ..nn.activations import Activation, swiglu
from ..nn.layers import KVCache, LayerCache, QuantRows, Rope, attention, host_heads, host_rows, move_tensors, rms_norm
from ..nn.qlinear import QLinear, Weight, ffn_one_token, gated, linear, linears
from ..nn.weights import DENSE, LINEAR, ROWS, linear_form, maybe, want


class SelfAttention(Protocol):
    """What a block needs of its attention: a whole-layer compiled call where one exists, and forward."""

    def decode_block(self, x: torch.Tensor, norm: torch.Tensor, eps: float, post_norm: torch.Tensor | None, pos0: int,
                     cache: LayerCache, rope: Rope) -> torch.Tensor | None: ...  # fmt: skip

    def __call__(self, h: torch.Tensor, pos0: int, cache: LayerCache, rope: Rope) -> torch.Tensor: ...


@dataclass(frozen=True)
class Family:
    neox_rope: bool = True  # rotate halves (False: adjacent pairs, for GGUF-permuted llama q/k)
    act: Activation = swiglu
    yarn_truncate: bool = True  # floor/ceil the YaRN correction range, as ggml does
    ffn_norm: str = "ffn_norm"  # tensor name of the norm before the FFN
    # The attention of a layer (default: the multi-head attention below): (layout, cfg, layer, quantized).
    attention: Callable[[Layout, ModelConfig, int, bool], SelfAttention] | None = None
    # What the family's files leave implicit: defaults for their `{arch}.` metadata keys (a key
    # the file holds wins), e.g. renormalised top-k weights or which layers slide.
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # A decoder of the family's own (Gemma 3), built as decoder(layout, cfg, n_ctx, **options); None: MoeDecoder.
    decoder: Callable[..., Any] | None = None


class Attention(nn.Module):
    def __init__(self, layout: Layout, cfg: ModelConfig, i: int, quantized: bool = False) -> None:
        super().__init__()
        p, form = f"blk.{i}.", linear_form(quantized)
        self.cfg, self.i = cfg, i
        self.wq, self.wk, self.wv = (want(layout, p + f"attn_{n}.weight", form) for n in "qkv")
        self.bq, self.bk, self.bv = (maybe(layout, p + f"attn_{n}.bias") for n in "qkv")
        self.wo = want(layout, p + "attn_output.weight", form)  # [E, H*Dv]
        self.bo = maybe(layout, p + "attn_output.bias")
        # QK norms act per head (Qwen3) or over the whole projection (OLMoE): the weight's size says which.
        self.q_norm = maybe(layout, p + "attn_q_norm.weight")
        self.k_norm = maybe(layout, p + "attn_k_norm.weight")
        # Decided by the q norm: with one KV head a per-head k norm has the size of the whole projection.
        q_norm = layout.tensors.get(p + "attn_q_norm.weight")
        self.qk_norm_per_head = q_norm is not None and q_norm.n_elements == cfg.head_dim
        self.sinks = maybe(layout, p + "attn_sinks.weight")  # [H]
        self.window = cfg.sliding_window if cfg.swa_layers and cfg.swa_layers[i] else 0

    def _cpu_decode(self, cache: LayerCache) -> bool:
        """Whether one token's rotary, cache write and attention can run compiled (`cpu_blocks`)."""
        cpu_f32 = cache.k.device.type == "cpu" and cache.k.dtype == torch.float32
        return cpu_f32 and not self.cfg.attn_softcap

    def _compiled(self, cache: LayerCache) -> bool:
        """Whether one token's whole attention, projections included, can run as one compiled call."""
        ws = (self.wq, self.wk, self.wv, self.wo)
        norms_fit = self.qk_norm_per_head or (self.q_norm is None and self.k_norm is None)
        biases_fit = (self.bq is None) == (self.bk is None) == (self.bv is None)
        one_kind = all(isinstance(w, QLinear) for w in ws) and len({getattr(w, "bits", 0) for w in ws}) == 1
        return one_kind and norms_fit and biases_fit and self._cpu_decode(cache)

    def block_call(self, norm: torch.Tensor, eps: float, post_norm: torch.Tensor | None, cache: LayerCache,
                   rope: Rope) -> AttentionBlockCall | None:  # fmt: skip
        """This layer's one-token compiled call on `cache` (`kernels.layer_halves`); None where there is none."""
        if not self._compiled(cache):
            return None
        cfg = self.cfg
        ws = tuple((w.raw, w.qtype) for w in (self.wq, self.wk, self.wv, self.wo) if isinstance(w, QLinear))
        biases = tuple(None if b is None else b.numpy() for b in (self.bq, self.bk, self.bv, self.bo))
        return AttentionBlockCall(
            norm.numpy(), eps, ws, biases, None if self.q_norm is None else self.q_norm.numpy(),
            None if self.k_norm is None else self.k_norm.numpy(), None if post_norm is None else post_norm.numpy(),
            (cfg.n_head, cfg.n_head_kv[self.i], cfg.head_dim), rope.parts(), rope.neox, self.window,
            cfg.head_dim**-0.5, getattr(self.wq, "bits", 16), None if self.sinks is None else self.sinks.numpy(),
        )  # fmt: skip

    def decode_block(self, x: torch.Tensor, norm: torch.Tensor, eps: float, post_norm: torch.Tensor | None, pos0: int,
                     cache: LayerCache, rope: Rope) -> torch.Tensor | None:  # fmt: skip
        """x + post_norm(attention(rms_norm(x))) for one token in one compiled call; None where it cannot."""
        call = self.block_call(norm, eps, post_norm, cache, rope) if x.shape[0] == 1 else None
        if call is None:
            return None
        return torch.from_numpy(call(host_rows(x), *host_heads(cache), pos0))

    def forward(self, h: torch.Tensor, pos0: int, cache: LayerCache, rope: Rope) -> torch.Tensor:
        q, k, v = linears(h, (self.wq, self.wk, self.wv), (self.bq, self.bk, self.bv))  # [T, H*D], [T, Hkv*D] x2
        return linear(self.attend(q, k, v, pos0, cache, rope).reshape(h.shape[0], -1), self.wo, self.bo)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, cache: LayerCache,
               rope: Rope) -> torch.Tensor:  # fmt: skip
        """Projected q [T, H*D], k and v [T, Hkv*D] -> QK norms, rotary, cache write, attention -> [T, H, Dv]."""
        cfg, t = self.cfg, q.shape[0]
        n_kv = cfg.n_head_kv[self.i]
        v = v.view(t, n_kv, cfg.head_dim_v)
        if not self.qk_norm_per_head:
            if self.q_norm is not None:
                q = rms_norm(q, self.q_norm, cfg.norm_eps)
            if self.k_norm is not None:
                k = rms_norm(k, self.k_norm, cfg.norm_eps)
        q, k = q.view(t, cfg.n_head, cfg.head_dim), k.view(t, n_kv, cfg.head_dim)
        if self.qk_norm_per_head:
            q = rms_norm(q, self.q_norm, cfg.norm_eps)  # per head: [T, H, D]
            if self.k_norm is not None:
                k = rms_norm(k, self.k_norm, cfg.norm_eps)
        if t == 1 and self._cpu_decode(cache):
            # One token on the CPU: rotary, cache write and attention in one compiled call.
            a = torch.from_numpy(decode_attention(
                host_rows(q[0]), host_rows(k[0]), host_rows(v[0]), rope.parts(), rope.neox, *host_heads(cache),
                pos0, self.window, cfg.head_dim**-0.5,
                None if self.sinks is None else self.sinks.numpy()))  # fmt: skip
            return a.view(1, cfg.n_head, cfg.head_dim_v)
        pos = torch.arange(pos0, pos0 + t, device=q.device)
        q, k = rope(q, pos), rope(k, pos)
        return attention(
            q, cache, k, v, pos0, scale=cfg.head_dim**-0.5, window=self.window, sinks=self.sinks,
            softcap=cfg.attn_softcap,
        )  # fmt: skip


class Routed(nn.Module):
    """A block part that routes tokens to experts; it remembers the experts of its latest call."""

    last_ids: torch.Tensor | None = None  # [T, k]

    def remember(self, ids: torch.Tensor) -> None:
        """Record the experts of the latest call (read by `routing()`). A plain attribute: nn.Module's own
        setattr looks through its parameters, buffers and modules first, microseconds a layer a token."""
        object.__setattr__(self, "last_ids", ids)


class DecoderBase(nn.Module):
    """What every decoder offers generation: its device, and the routing of the last step."""

    cfg: ModelConfig
    embed: torch.Tensor | QuantRows  # [V, E]
    norm: torch.Tensor
    output: Weight  # [V, E]; the embedding's matrix when the file ties them
    experts: ExpertExecutor
    blocks: nn.ModuleList  # each with .ffn and .ffn_norm

    def _build_ends(self, layout: Layout, quantized: bool = False) -> None:
        """The token embedding, the final norm and the output projection.

        `quantized` (the CPU kernels): the output projection runs from the file's bytes and the
        embedding is looked up row by row, so no float copy of either is made. The vocabulary
        projection is the largest matrix a small model reads per token (Gemma 3 270M: 262k x 640,
        671 MB in fp32). Types without a kernel load as float32, and a tied embedding shares the
        output's copy.
        """
        self.norm = want(layout, "output_norm.weight")
        name = "output.weight" if "output.weight" in layout.tensors else "token_embd.weight"
        output = want(layout, name, linear_form(quantized))
        self.output = output
        if output.form != LINEAR and name == "token_embd.weight":
            self.embed = output  # tied: the load reads it once for both
        else:
            self.embed = want(layout, "token_embd.weight", ROWS if quantized else DENSE)

    def _build_experts(self, layout: Layout, act: Activation, kernels: str, dequant_mib: float) -> None:
        """The MoE layers (those the layout has routers for); their experts are read at load, in place."""
        self.moe_layers = [i for i in range(self.cfg.n_layers) if is_moe_layer(layout, i)]
        self._expert_options = (act, kernels, dequant_mib)
        self.host_experts = HostExperts({}, act, kernels=kernels, dequant_mib=dequant_mib)
        self.experts: ExpertExecutor = NoExperts()

    def on_load(self, source: Source) -> None:
        """The host copy of the experts (views of the source's bytes); the executor a model starts with."""
        act, kernels, dequant_mib = self._expert_options
        layers = {i: load_layer_experts(source, i) for i in self.moe_layers}
        self.host_experts = HostExperts(layers, act, kernels=kernels, dequant_mib=dequant_mib)
        self.experts = self.host_experts if layers else NoExperts()

    def prefetch_next(self, i: int, x: torch.Tensor) -> None:
        """After block i: if the expert cache prefetches for this many tokens (not a prefill, which goes
        around the cache), predict block i+1's experts from x (block i's output) with block i+1's FFN
        norm and router, and hand them to the cache."""
        if x.shape[0] > getattr(self.experts, "prefetch_tokens", 0) or i + 1 >= len(self.blocks):
            return
        nxt: Any = self.blocks[i + 1]
        if isinstance(nxt.ffn, MoeFFN):
            ids, _ = nxt.ffn.select(rms_norm(x, nxt.ffn_norm, self.cfg.norm_eps))
            self.experts.prefetch(i + 1, ids)  # type: ignore[attr-defined]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states [T, E] -> logits [T, V]."""
        return linear(rms_norm(x, self.norm, self.cfg.norm_eps), self.output)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> hidden states [T, E]."""
        return self.embed[tokens.to(self.embed.device)]

    def run_blocks(self, x: torch.Tensor, pos0: int, cache: KVCache, first: int, end: int) -> torch.Tensor:
        """Blocks first..end-1 on x [T, E] at positions pos0..; they append to their layers of `cache`.
        A pipeline's stage runs its own range (engine.distributed)."""
        if x.shape[0] == 1:
            out = self._two_call_layers(x, pos0, cache, first, end)
            if out is not None:
                return out
        for i in range(first, end):
            x = self.blocks[i](x, pos0, cache.layers[i], self.rope, self.experts)
            self.prefetch_next(i, x)
        return x

    def _two_call_layers(self, x: torch.Tensor, pos0: int, cache: KVCache, first: int, end: int) -> torch.Tensor | None:
        """One token x [1, E] through blocks first..end-1, two compiled calls a layer (`Block.decode_layer`) in
        one tight loop, where every one of them has the calls (else None). Each call streams megabytes of
        weights through the caches, so the Python between calls runs from cold caches: per layer, the
        block's own plumbing cost more than a tenth of a millisecond. The calls are checked first,
        then run back to back, then the routing is recorded."""
        rope = getattr(self, "rope", None)
        if not isinstance(rope, Rope):  # (Gemma's two ropes: its blocks are its own)
            return None
        calls, ffns = [], []
        for i in range(first, end):
            block = self.blocks[i]
            layer = cache.layers[i]
            c = block.layer_calls(layer, rope, self.experts) if isinstance(block, Block) else None
            if c is None or c.attention is None or c.ffn is None:
                return None
            calls.append((c.attention, c.ffn, *host_heads(layer)))
            ffns.append(cast(MoeFFN, block.ffn))
        h, chosen = host_rows(x), []
        for attend, experts, k, v in calls:
            ids, _, h = experts(attend(h, k, v, pos0))
            chosen.append(ids)
        self.experts.account([moe.i for moe in ffns], chosen)
        for moe, ids in zip(ffns, chosen, strict=True):
            moe.remember(torch.from_numpy(ids))
        return torch.from_numpy(h)

    def forward(self, tokens: torch.Tensor, pos0: int, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """tokens [T] at positions pos0.. -> logits [T, V]; appends to `cache`."""
        x = self.run_blocks(self.embed_tokens(tokens), pos0, cache, 0, len(self.blocks))  # [T, E]
        cache.pos = pos0 + tokens.shape[0]
        return self.head(x[-1:] if last_only else x)  # [T or 1, V]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def routing(self) -> tuple[tuple[int, ...], ...]:
        """Per MoE layer, the experts selected by the last token of the latest forward pass."""
        return tuple(
            tuple(m.last_ids[-1].tolist()) for m in self.modules() if isinstance(m, Routed) and m.last_ids is not None
        )


class MoeFFN(Routed):
    """Router -> expert execution (behind `ExpertExecutor`) -> plus the shared expert, if any."""

    def __init__(self, layout: Layout, cfg: ModelConfig, i: int, act: Activation, quantized: bool = False) -> None:
        super().__init__()
        p, form = f"blk.{i}.", linear_form(quantized)
        self.cfg, self.i, self.act = cfg, i, act
        self.router = want(layout, p + "ffn_gate_inp.weight")  # [n_expert, E]
        self.router_bias = maybe(layout, p + "ffn_gate_inp.bias")  # added to the logits
        self.choice_bias = maybe(layout, p + "exp_probs_b.bias")  # added to the scores, for the choice only
        self.sh_gate = maybe(layout, p + "ffn_gate_shexp.weight", form)
        self.sh_up = maybe(layout, p + "ffn_up_shexp.weight", form)
        self.sh_down = maybe(layout, p + "ffn_down_shexp.weight", form)
        self.sh_gate_inp = maybe(layout, p + "ffn_gate_inp_shexp.weight")  # [E]

    def select(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised hidden states [T, E] -> the experts it routes them to (ids [T, k], weights [T, k])."""
        cfg = self.cfg
        if self._compiled_routing(h, FEW_ROWS):  # one call
            i, w = route_rows(host_rows(h), self.router.numpy(), None if self.router_bias is None else
                              self.router_bias.numpy(), cfg.expert_gating, cfg.n_expert_used, cfg.expert_weights_norm,
                              cfg.expert_weights_scale)  # fmt: skip
            return torch.from_numpy(i), torch.from_numpy(w)
        return route(F.linear(h, self.router, self.router_bias), cfg, self.choice_bias)  # [T, k] each

    def _compiled_routing(self, h: torch.Tensor, rows: int) -> bool:
        """Whether up to `rows` rows of h route in one compiled call with their logits (`route_rows`):
        float32 on the CPU, and no choice bias or expert groups (which that call does not take)."""
        return (self._routing_compiles() and h.shape[0] <= rows and h.device.type == "cpu"
                and h.dtype == torch.float32)  # fmt: skip

    def _routing_compiles(self) -> bool:
        return self.choice_bias is None and self.cfg.expert_groups == 1

    def one_token_call(self, experts: ExpertExecutor, norm: torch.Tensor | None = None,
                       eps: float = 0.0) -> MoeTokenCall | None:  # fmt: skip
        """One token's routing and routed experts in one compiled call, with `norm` also the FFN's norm
        before and the residual add after (`kernels.moe_token`); None where the executor offers no such
        call for the layer or the routing has no compiled form. Its caller owes the executor the ids."""
        if not self._routing_compiles():
            return None
        call = experts.token_call(self.i)
        if call is None:
            return None
        cfg = self.cfg
        return MoeTokenCall(self.router.numpy(), None if self.router_bias is None else self.router_bias.numpy(),
                            cfg.expert_gating, cfg.n_expert_used, cfg.expert_weights_norm, cfg.expert_weights_scale,
                            *call, norm=None if norm is None else norm.numpy(), eps=eps)  # fmt: skip

    def routed_token(self, h: torch.Tensor, experts: ExpertExecutor) -> torch.Tensor | None:
        """One token's routed experts in one compiled call, bit-identical to select() then experts(); None
        where that call cannot run it."""
        call = self.one_token_call(experts) if h.shape[0] == 1 and self._compiled_routing(h, 1) else None
        if call is None:
            return None
        ids, _, y = call(host_rows(h))
        experts.account((self.i,), (ids,))
        self.remember(torch.from_numpy(ids))
        return torch.from_numpy(y)

    def layer_call(self, experts: ExpertExecutor, norm: torch.Tensor, eps: float) -> MoeTokenCall | None:
        """A decode layer's FFN half in one compiled call: x + the routed experts of rms_norm(x), from the
        host copy (cache off); None where the layer has shared experts or routing with no compiled form."""
        return None if self.sh_gate is not None else self.one_token_call(experts, norm, eps)

    def forward(self, h: torch.Tensor, experts: ExpertExecutor) -> torch.Tensor:
        y = self.routed_token(h, experts)
        if y is None:
            ids, weights = self.select(h)
            self.remember(ids)
            y = experts(self.i, h, ids, weights)
        if self.sh_gate is not None and self.sh_up is not None and self.sh_down is not None:
            shared = ffn_one_token(h, self.sh_gate, self.sh_up, self.sh_down, self.act)
            if shared is None:
                shared = linear(gated(h, self.sh_gate, self.sh_up, self.act), self.sh_down)
            if self.sh_gate_inp is not None:
                shared = shared * torch.sigmoid(h @ self.sh_gate_inp.reshape(-1, 1))
            y = y + shared
        return y


class DenseFFN(nn.Module):
    """A layer's FFN without experts: dense models, and the dense lead layers of some MoE models."""

    def __init__(self, layout: Layout, i: int, act: Activation, quantized: bool = False) -> None:
        super().__init__()
        self.act, form = act, linear_form(quantized)
        self.gate = want(layout, f"blk.{i}.ffn_gate.weight", form)  # [F, E]
        self.up = want(layout, f"blk.{i}.ffn_up.weight", form)
        self.down = want(layout, f"blk.{i}.ffn_down.weight", form)  # [E, F]

    def forward(self, h: torch.Tensor, experts: ExpertExecutor) -> torch.Tensor:
        return linear(gated(h, self.gate, self.up, self.act), self.down)

    def decode_block(self, x: torch.Tensor, norm: torch.Tensor, eps: float,
                     post_norm: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
        """x + post_norm(ffn(rms_norm(x))) for one token in one compiled call; None where it cannot."""
        return ffn_one_token(x, self.gate, self.up, self.down, self.act, norm=norm, eps=eps, post_norm=post_norm,
                             residual=True)  # fmt: skip


def is_moe_layer(layout: Layout, i: int) -> bool:
    """A layer routes to experts when the file holds its router."""
    return f"blk.{i}.ffn_gate_inp.weight" in layout.tensors


def ffn_for(layout: Layout, cfg: ModelConfig, i: int, act: Activation, quantized: bool) -> MoeFFN | DenseFFN:
    return MoeFFN(layout, cfg, i, act, quantized) if is_moe_layer(layout, i) else DenseFFN(layout, i, act, quantized)


class NoExperts:
    """The executor of a model without MoE layers: nothing calls it."""

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a dense model has no experts")

    def token_call(self, layer: int) -> None:
        return None

    def account(self, layers: Sequence[int], ids: Sequence[Any]) -> None:
        raise RuntimeError("a dense model has no experts")


@dataclass(frozen=True)
class LayerCalls:
    """A decode layer's two compiled calls (None: the layer has none) and what they were built for.

    The executor is held weakly and no KV cache at all: a block keeps its calls between tokens, and must
    not keep a closed expert cache's or a finished chat's memory alive."""

    executor: weakref.ref[Any]
    key: tuple[Any, ...]  # compared by identity: the experts' call, the rope's table, the bits, the cache's kind
    attention: AttentionBlockCall | None
    ffn: MoeTokenCall | None

    def built_for(self, executor: Any, key: tuple[Any, ...]) -> bool:
        return self.executor() is executor and all(a is b for a, b in zip(self.key, key, strict=True))


class Block(nn.Module):
    # A decode token through a layer of attention and routed experts (cache off) takes two compiled calls
    # with next to no Python between them (`decode_layer`); False: the per-part path (bench/decode_parts).
    whole_layer_calls = True

    def __init__(self, layout: Layout, cfg: ModelConfig, i: int, family: Family, quantized: bool) -> None:
        super().__init__()
        self.attn_norm = want(layout, f"blk.{i}.attn_norm.weight")
        self.ffn_norm = want(layout, f"blk.{i}.{family.ffn_norm}.weight")
        self.attn = (family.attention or Attention)(layout, cfg, i, quantized)
        self.ffn = ffn_for(layout, cfg, i, family.act, quantized)
        self.eps = cfg.norm_eps
        self._calls: LayerCalls | None = None

    def layer_calls(self, cache: LayerCache, rope: Rope, experts: ExpertExecutor) -> LayerCalls | None:
        """The layer's two compiled decode calls on this cache and executor (see `decode_layer`); None when
        switched off (`whole_layer_calls`)."""
        if not self.whole_layer_calls:
            return None
        # What the calls bind can change between tokens only with one of these: another executor (the expert
        # cache switched), other activation bits (a new experts' call), another rope, a cache of another kind.
        token_call = experts.token_call(self.ffn.i) if isinstance(self.ffn, MoeFFN) else None
        bits = getattr(getattr(self.attn, "wq", None), "bits", None)
        key = (token_call, rope.cis, bits, cache.k.dtype, cache.k.is_cpu)
        calls = self._calls
        if calls is None or not calls.built_for(experts, key):
            attention = ffn = None
            if token_call is not None and isinstance(self.ffn, MoeFFN) and isinstance(self.attn, Attention):
                ffn = self.ffn.layer_call(experts, self.ffn_norm, self.eps)
                attention = self.attn.block_call(self.attn_norm, self.eps, None, cache, rope) if ffn else None
            calls = self._calls = LayerCalls(weakref.ref(experts), key, attention, ffn)
        return calls

    def decode_layer(self, x: torch.Tensor, pos0: int, cache: LayerCache, rope: Rope,
                     experts: ExpertExecutor) -> torch.Tensor | None:  # fmt: skip
        """One token x [1, E] through the layer in two compiled calls (the attention block; the FFN norm,
        the routed experts and the residual), bit-identical to the per-part path; None where the layer
        or the executor has no such calls."""
        calls = self.layer_calls(cache, rope, experts)
        if calls is None or calls.attention is None or calls.ffn is None:
            return None
        a = calls.attention(host_rows(x), *host_heads(cache), pos0)  # [1, E]
        ids, _, out = calls.ffn(a)
        moe = cast(MoeFFN, self.ffn)  # calls.ffn: a MoeFFN
        experts.account((moe.i,), (ids,))
        moe.remember(torch.from_numpy(ids))
        return torch.from_numpy(out)

    def forward(
        self, x: torch.Tensor, pos0: int, cache: LayerCache, rope: Rope, experts: ExpertExecutor
    ) -> torch.Tensor:
        if x.shape[0] == 1:
            out = self.decode_layer(x, pos0, cache, rope, experts)
            if out is not None:
                return out
        fast = self.attn.decode_block(x, self.attn_norm, self.eps, None, pos0, cache, rope)
        x = fast if fast is not None else x + self.attn(rms_norm(x, self.attn_norm, self.eps), pos0, cache, rope)
        fast = self.ffn.decode_block(x, self.ffn_norm, self.eps) if isinstance(self.ffn, DenseFFN) else None
        return fast if fast is not None else x + self.ffn(rms_norm(x, self.ffn_norm, self.eps), experts)


class MoeDecoder(DecoderBase):
    """Token embedding -> blocks -> norm -> output projection, for the llama-like families (MoE or dense)."""

    def __init__(
        self, layout: Layout, cfg: ModelConfig, n_ctx: int, family: Family, *, quantized: bool = False,
        kernels: str = "fast", dequant_mib: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.cfg = cfg
        self._build_ends(layout, quantized)
        self.blocks = nn.ModuleList(Block(layout, cfg, i, family, quantized) for i in range(cfg.n_layers))
        self.rope = Rope(cfg.rope_dim, cfg.rope_theta, n_ctx, neox=family.neox_rope, cfg=cfg,
                         truncate=family.yarn_truncate)  # fmt: skip
        self._build_experts(layout, family.act, kernels, dequant_mib)

    def to_device(self, device: torch.device) -> MoeDecoder:
        """Move everything but the experts (they stay in host memory) to `device`."""
        move_tensors(self, device)
        self.rope.to(device)
        return self
