"""The decoder every supported family shares; a family module picks its rope, activation and quirks.

Features are switched on by what the file holds (biases, QK norms, sinks, shared experts,
router bias) and by the config (sliding-window layers, gating), never by the model's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ..config import ModelConfig
from ..gguf.sources import Layout, Source
from ..kernels import threads
from ..moe.expert_tensors import load_layer_experts
from ..moe.host_experts import ExpertExecutor, HostExperts
from ..moe.routing import select
from ..nn.activations import Activation, swiglu
from ..nn.layers import KVCache, LayerCache, QuantRows, Rope, move_tensors, rms_norm, rope_attention
from ..nn.qlinear import Weight, ffn, linear, linear_rows, linears, set_activation_bits
from ..nn.weights import DENSE, LINEAR, ROWS, linear_form, maybe, want


class Plan(Protocol):
    """How one token (or one of each of several sequences) runs through blocks first..end-1 (`DecodePlan`)."""

    def run(self, x: torch.Tensor, pos0: int, cache: KVCache, first: int, end: int) -> torch.Tensor: ...

    def run_rows(self, x: torch.Tensor, caches: Sequence[KVCache], first: int, end: int) -> torch.Tensor:
        """n tokens of n sequences, each at its cache's position, each the bits it gets alone (`run`)."""
        ...

    def describe(self) -> str: ...


Planner = Callable[["DecoderBase", tuple[str, torch.dtype]], Plan]  # (model, the KV cache's kind) -> its plan


class SelfAttention(Protocol):
    """A layer's token mixing: normed hidden states [T, E] at positions pos0.. -> [T, E]."""

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
    # Norms after the attention and the FFN as well ("sandwich", Gemma): post_attention_norm, post_ffw_norm.
    post_norms: bool = False


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
        return rope_attention(q, k, v, pos0, cache, rope, scale=cfg.head_dim**-0.5, window=self.window,
                              sinks=self.sinks, softcap=cfg.attn_softcap)  # fmt: skip


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
    blocks: nn.ModuleList  # of Block
    _experts: ExpertExecutor
    _plans: dict[tuple[str, torch.dtype], Plan]
    # What makes a decode plan (`decode_plan.DecodePlan.build`): `models.build_model` hands it over, as the
    # plan is made from this module's classes.
    planner: Planner | None = None

    @property
    def experts(self) -> ExpertExecutor:
        """How the routed experts run (the host copy, or an expert cache); setting it drops the decode plans."""
        return self._experts

    @experts.setter
    def experts(self, executor: ExpertExecutor) -> None:
        object.__setattr__(self, "_experts", executor)
        self.drop_plans()

    def drop_plans(self) -> None:
        """What a decode plan binds has changed (the executor, the activations' bits, the device): plan again."""
        object.__setattr__(self, "_plans", {})

    def layer_rope(self, i: int) -> Rope:
        """The rotary table of layer i."""
        rope = getattr(self, "rope", None)
        if not isinstance(rope, Rope):
            raise NotImplementedError(f"{type(self).__name__} gives each layer its rotary table")
        return rope

    def set_activation_bits(self, bits: int, prompt_bits: int, prompt_rows_bits: int | None = None) -> None:
        """The CPU kernels' activation widths (`kernels.isa.activation_bits`), in the dense matrices and the experts."""
        set_activation_bits(self, bits, prompt_bits)
        self.host_experts.set_bits(bits, prompt_bits, prompt_rows_bits)
        self.drop_plans()

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
        self.experts = NoExperts()

    def on_load(self, source: Source) -> None:
        """The host copy of the experts (views of the source's bytes); the executor a model starts with."""
        act, kernels, dequant_mib = self._expert_options
        layers = {i: load_layer_experts(source, i) for i in self.moe_layers}
        self.host_experts = HostExperts(layers, act, kernels=kernels, dequant_mib=dequant_mib)
        self.experts = self.host_experts if layers else NoExperts()

    def prefetch_next(self, i: int, x: torch.Tensor) -> None:
        """Before block i's FFN: if the executor looks ahead for this many tokens (not a prefill, which goes around
        a device cache) and blocks i and i+1 are MoE layers, predict block i+1's experts from x (block i's FFN
        input) with block i+1's FFN norm and router, and hand them to the executor (the device cache, or the RAM
        tier), which fetches them while block i computes."""
        if x.shape[0] > self.experts.prefetch_tokens or i + 1 >= len(self.blocks):
            return
        here: Any = self.blocks[i]
        nxt: Any = self.blocks[i + 1]
        if isinstance(nxt.ffn, MoeFFN) and isinstance(here.ffn, MoeFFN):  # one MoE layer ahead of another
            ids, _ = nxt.ffn.select(rms_norm(x, nxt.ffn_norm, self.cfg.norm_eps))
            self.experts.prefetch(i + 1, ids)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states [T, E] -> logits [T, V]."""
        return linear(rms_norm(x, self.norm, self.cfg.norm_eps), self.output)

    def step(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
        """One decode step of n sequences: token t at position caches[t].pos over caches[t] (slots of one bank,
        `KVBank`, for the compiled calls to take them together) -> logits [n, V]. Each row is what `forward`
        gives that token alone, bit for bit, whatever else runs beside it."""
        if not caches or len(tokens) != len(caches):
            raise ValueError(f"a step of {len(tokens)} tokens over {len(caches)} caches")
        x = self.embed_tokens(torch.tensor(list(tokens)))  # [n, E]
        x = self.decode_plan(caches[0]).run_rows(x, caches, 0, len(self.blocks))
        for c in caches:
            c.pos += 1
        return linear_rows(rms_norm(x, self.norm, self.cfg.norm_eps), self.output)  # [n, V]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> hidden states [T, E]."""
        return self.embed[tokens.to(self.embed.device)]

    def run_blocks(self, x: torch.Tensor, pos0: int, cache: KVCache, first: int, end: int) -> torch.Tensor:
        """Blocks first..end-1 on x [T, E] at positions pos0..; they append to their layers of `cache`.
        A pipeline's stage runs its own range (engine.distributed). One token runs the decode plan."""
        if x.shape[0] == 1:
            return self.decode_plan(cache).run(x, pos0, cache, first, end)
        ahead = x.shape[0] <= self.experts.prefetch_tokens
        for i in range(first, end):
            threads.pace()  # a long prompt's layers follow other processes' load as it changes
            block = self.blocks[i]
            if ahead and isinstance(block, Block):
                x = block.attention_half(x, pos0, cache.layers[i], self.layer_rope(i))
                if i + 1 < end:
                    self.prefetch_next(i, x)
                x = block.ffn_half(x, self.experts)
            else:
                x = block(x, pos0, cache.layers[i], self.layer_rope(i), self.experts)
        return x

    def decode_plan(self, cache: KVCache) -> Plan:
        """The plan one token runs on a KV cache of this kind: made at the first token, then kept."""
        kind = (cache.device.type, cache.layers[0].k.dtype)
        plan = self._plans.get(kind)
        if plan is None:
            if self.planner is None:
                raise RuntimeError(f"{type(self).__name__}: no decode planner (models are made by build_model)")
            plan = self._plans[kind] = self.planner(self, kind)
        return plan

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
        return select(h, self.router, self.router_bias, self.cfg, self.choice_bias)

    def shared(self, h: torch.Tensor) -> torch.Tensor | None:
        """The shared expert on h [T, E] (behind its sigmoid gate, if any); None: the layer has none."""
        if self.sh_gate is None or self.sh_up is None or self.sh_down is None:
            return None
        out = ffn(h, self.sh_gate, self.sh_up, self.sh_down, self.act)
        if self.sh_gate_inp is not None:
            out = out * torch.sigmoid(linear_rows(h, self.sh_gate_inp.reshape(1, -1)))
        return out

    def forward(self, h: torch.Tensor, experts: ExpertExecutor) -> torch.Tensor:
        ids, weights = self.select(h)
        self.remember(ids)
        return self.with_shared(h, experts(self.i, h, ids, weights))

    def with_shared(self, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The layer's output from its routed experts' sum on h: plus the shared expert, where it has one."""
        shared = self.shared(h)
        return routed if shared is None else routed + shared


class DenseFFN(nn.Module):
    """A layer's FFN without experts: dense models, and the dense lead layers of some MoE models."""

    def __init__(self, layout: Layout, i: int, act: Activation, quantized: bool = False) -> None:
        super().__init__()
        self.act, form = act, linear_form(quantized)
        self.gate = want(layout, f"blk.{i}.ffn_gate.weight", form)  # [F, E]
        self.up = want(layout, f"blk.{i}.ffn_up.weight", form)
        self.down = want(layout, f"blk.{i}.ffn_down.weight", form)  # [E, F]

    def forward(self, h: torch.Tensor, experts: ExpertExecutor) -> torch.Tensor:
        return ffn(h, self.gate, self.up, self.down, self.act)


def is_moe_layer(layout: Layout, i: int) -> bool:
    """A layer routes to experts when the file holds its router."""
    return f"blk.{i}.ffn_gate_inp.weight" in layout.tensors


def ffn_for(layout: Layout, cfg: ModelConfig, i: int, act: Activation, quantized: bool) -> MoeFFN | DenseFFN:
    return MoeFFN(layout, cfg, i, act, quantized) if is_moe_layer(layout, i) else DenseFFN(layout, i, act, quantized)


class NoExperts:
    """The executor of a model without MoE layers: nothing calls it."""

    prefetch_tokens = 0

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a dense model has no experts")

    def token_call(self, layer: int) -> None:
        return None

    def account(self, layers: Sequence[int], ids: Sequence[Any], ahead: Any = None) -> None:
        raise RuntimeError("a dense model has no experts")

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        raise RuntimeError("a dense model has no experts")


class Block(nn.Module):
    """x + post(attention(norm(x))), then x + post(ffn(norm(x))): the post norms only where the family has them."""

    def __init__(self, layout: Layout, cfg: ModelConfig, i: int, family: Family, quantized: bool) -> None:
        super().__init__()
        p = f"blk.{i}."
        self.attn_norm = want(layout, p + "attn_norm.weight")
        self.ffn_norm = want(layout, p + f"{family.ffn_norm}.weight")
        self.post_attn_norm = want(layout, p + "post_attention_norm.weight") if family.post_norms else None
        self.post_ffn_norm = want(layout, p + "post_ffw_norm.weight") if family.post_norms else None
        self.attn = (family.attention or Attention)(layout, cfg, i, quantized)
        self.ffn = ffn_for(layout, cfg, i, family.act, quantized)
        self.eps = cfg.norm_eps

    def attention_half(self, x: torch.Tensor, pos0: int, cache: LayerCache, rope: Rope) -> torch.Tensor:
        a = self.attn(rms_norm(x, self.attn_norm, self.eps), pos0, cache, rope)
        return x + (a if self.post_attn_norm is None else rms_norm(a, self.post_attn_norm, self.eps))

    def ffn_half(self, x: torch.Tensor, experts: ExpertExecutor) -> torch.Tensor:
        return self.ffn_out(x, self.ffn(rms_norm(x, self.ffn_norm, self.eps), experts))

    def ffn_out(self, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """The FFN half from the FFN's output f on norm(x): x + f, f through the post norm where there is one."""
        return x + (f if self.post_ffn_norm is None else rms_norm(f, self.post_ffn_norm, self.eps))

    def forward(
        self, x: torch.Tensor, pos0: int, cache: LayerCache, rope: Rope, experts: ExpertExecutor
    ) -> torch.Tensor:
        return self.ffn_half(self.attention_half(x, pos0, cache, rope), experts)


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
        self.drop_plans()
        return self
