"""One token's way through a model, chosen once: per layer, the calls it runs.

The model's modules say what the maths is: a block is x + attention(norm(x)), then x + ffn(norm(x))
(`decoder.Block`), in torch, which a prompt runs and the tests hold everything else to. A decode
token runs a plan made from them at its first token, for the model's executor (host copy or expert
cache), activation widths and KV cache's kind, and kept until one of those changes
(`DecoderBase.drop_plans`). Per layer it holds two halves, each the compiled call the kernels
have for the layer's weights where there is one, else the module's own half:

- attention: `layer_halves.AttentionBlockCall` (norm, projections, rotary, cache write, attention,
  post norm, residual) for multi-head attention over quantized matrices and a float32 CPU cache;
- a MoE FFN: the executor's token call (`kernels.moe_token`: routing and the routed experts, with
  the norm and residual around it) where the executor offers one; with a shared expert or a post
  norm, that call on the normed token and the rest in torch as the module computes it;
- a dense FFN: `layer_halves.FfnBlockCall` (norm, gated FFN, post norm, residual).

Where every layer of the range has both halves as compiled calls on host rows, the token runs
them back to back over float32 arrays (each call streams megabytes of weights, so the Python
between two of them runs on cold caches) and hands the executor the token's routing once, after
its last layer: the expert cache steps its policy for every layer in one compiled call a group.
An expert cache whose slots are the host copy asks for look-ahead there too: before each MoE layer's call
the next MoE layer's routing (its norm and router, compiled) predicts its experts from this layer's FFN
input, and the token's predictions and the times its lookups came go to the executor with its routing
(`TokenAhead`). An expert cache that reads its plan before computing (a device's slots) offers no token
call: its layers run the module's FFN half, which calls the cache per layer, and the decoder hands it
each prediction before the FFN half (`prefetch`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..kernels.layer_halves import AttentionBlockCall, FfnBlockCall, rms_rows, route_rows
from ..kernels.moe_token import MoeTokenCall
from ..moe.host_experts import ExpertExecutor, TokenAhead
from ..nn.layers import KVCache, LayerCache, Rope, host_heads, host_rows, rms_norm
from ..nn.qlinear import QLinear, ffn_call
from .decoder import Attention, Block, DenseFFN, MoeFFN

if TYPE_CHECKING:
    from .decoder import DecoderBase

logger = logging.getLogger(__name__)

AttentionHalf = Callable[[torch.Tensor, int, LayerCache], torch.Tensor]  # (x [1, E], pos0, layer's cache) -> x'
FfnHalf = Callable[[torch.Tensor], torch.Tensor]  # x [1, E] -> x'
Kind = tuple[str, torch.dtype]  # the KV cache's device type and dtype
Predict = Callable[[np.ndarray], np.ndarray]  # block i's FFN input h [1, E] -> block i+1's predicted experts [1, k]


@dataclass(frozen=True)
class LayerPlan:
    """A layer's two halves for one token, and what each is (for `describe`)."""

    attention: AttentionHalf
    ffn: FfnHalf
    kinds: tuple[str, str]  # each half: "compiled", "routed call", "module" or "skipped"
    # Both halves as compiled calls on host rows (the tight loop), where they are: a MoE layer's FFN call
    # returns (ids, weights, x'), a dense one x'.
    calls: tuple[AttentionBlockCall, MoeTokenCall | FfnBlockCall] | None = None
    moe: MoeFFN | None = None
    attend: AttentionBlockCall | None = None  # the attention half's compiled call, where it is one (a step's rows)
    predict: Predict | None = None  # the next layer's experts from this layer's FFN input (look-ahead)


class AheadCell:
    """The look-ahead made at the layer a token is at, which its token-call FFN half tells the executor with its
    ids: the next MoE layer's experts predicted from this layer's FFN input (None: none), and when."""

    __slots__ = ("active", "at", "owed", "predicted")

    def __init__(self) -> None:
        self.active = False
        self.predicted: np.ndarray | None = None
        self.at = 0.0
        # In a step of several tokens (`DecodePlan.run_rows`): the token-call halves' (layer, ids [n, k]), told
        # the executor per token after the step.
        self.owed: list[tuple[int, np.ndarray]] | None = None

    def tell(self, experts: ExpertExecutor, layer: int, ids: np.ndarray) -> None:
        """A token-call half's lookups: told the executor now (one token), or after the step (several)."""
        if self.owed is not None:
            self.owed.append((layer, ids))
        else:
            experts.account((layer,), (ids,), self.told())

    def told(self) -> TokenAhead | None:
        return TokenAhead((self.predicted,), (self.at,)) if self.active else None


class DecodePlan:
    """Per layer, the calls one token runs (`LayerPlan`); `run` is a decode step's blocks."""

    def __init__(self, model: DecoderBase, layers: list[LayerPlan], cell: AheadCell | None = None) -> None:
        self.model = model
        self.layers = layers
        self.prefetch = model.experts.prefetch_tokens >= 1
        self.cell = cell or AheadCell()
        self.cell.active = self.prefetch
        # Layers before i without both compiled calls: a range [a, b) runs the tight loop when none is.
        self._loose = np.concatenate([[0], np.cumsum([p.calls is None for p in layers])]).tolist()

    @classmethod
    def build(cls, model: DecoderBase, kind: Kind, *, attention: bool = True, compiled: bool = True) -> DecodePlan:
        """The plan for `model` as it now is, on a KV cache of `kind`. `attention=False` skips every attention
        half (what compiles a model's other kernels ahead, `compile_ahead`); `compiled=False` runs every
        half as its module does (the reference the tests and `bench/decode_parts.py` compare with)."""
        on_cpu = model.device.type == "cpu" and compiled
        cpu_f32 = kind == ("cpu", torch.float32) and compiled
        layers = []
        cell = AheadCell()
        for i, block in enumerate(model.blocks):
            if not isinstance(block, Block):
                raise TypeError(f"layer {i}: a decode plan runs decoder.Block layers, not {type(block).__name__}")
            rope = model.layer_rope(i)
            attn_call = _attention_call(block, rope) if cpu_f32 and attention else None
            if not attention:
                attn: AttentionHalf = _skipped
            elif attn_call is not None:
                attn = _compiled_attention(attn_call)
            else:
                attn = _module_attention(block, rope)
            ffn, ffn_kind, ffn_call = _ffn_half(model, block, cell) if on_cpu else (_module_ffn(model, block), "module",
                                                                                      None)  # fmt: skip
            calls = (attn_call, ffn_call) if attn_call is not None and ffn_call is not None else None
            kinds = ("skipped" if not attention else "compiled" if attn_call else "module", ffn_kind)
            moe = block.ffn if isinstance(block.ffn, MoeFFN) else None
            layers.append(LayerPlan(attn, ffn, kinds, calls, moe, attn_call))
        for i, p in enumerate(layers[:-1]):
            # A token-call half tells its executor the prediction for the next layer with its ids (AheadCell);
            # elsewhere the decoder hands its own to the executor before the FFN half (`prefetch_next`).
            if p.moe is not None and p.kinds[1] in ("compiled", "routed call"):
                nxt = model.blocks[i + 1]
                layers[i] = replace(p, predict=_predictor(nxt) if isinstance(nxt, Block) else None)
        plan = cls(model, layers, cell)
        logger.debug("decode plan: %s", plan.describe())
        return plan

    def describe(self) -> str:
        """Each distinct pair of halves and the layers that run it, in words."""
        runs: dict[tuple[str, str], list[int]] = {}
        for i, p in enumerate(self.layers):
            runs.setdefault(p.kinds, []).append(i)
        return "; ".join(f"layers {_span(ls)}: attention {a}, FFN {f}" for (a, f), ls in runs.items())

    def run(self, x: torch.Tensor, pos0: int, cache: KVCache, first: int, end: int) -> torch.Tensor:
        """One token x [1, E] at position pos0 through layers first..end-1 -> [1, E]; appends to `cache`."""
        if self._loose[end] == self._loose[first]:
            return self._run_calls(x, (cache,), np.array([pos0], np.int64), first, end)
        model, layers = self.model, self.layers
        if not self.prefetch:
            for i in range(first, end):
                p = layers[i]
                x = p.ffn(p.attention(x, pos0, cache.layers[i]))
            return x
        cell, now = self.cell, time.perf_counter
        for i in range(first, end):
            p = layers[i]
            x = p.attention(x, pos0, cache.layers[i])
            cell.at = now()
            cell.predicted = p.predict(host_rows(x)) if p.predict is not None and i + 1 < end else None
            if p.predict is None and i + 1 < end:
                model.prefetch_next(i, x)  # (a module's FFN half after it, or none: the decoder's own)
            x = p.ffn(x)
        return x

    def run_rows(self, x: torch.Tensor, caches: Sequence[KVCache], first: int, end: int) -> torch.Tensor:
        """n tokens x [n, E] of n sequences, token t at position caches[t].pos over caches[t], through layers
        first..end-1 -> [n, E]. Each token computes the bits it computes alone (`run`): a layer's compiled calls
        take all n rows (each matrix read once for them, each expert once for the tokens routed to it), a
        module's attention half runs token by token, a module's FFN half on all n. The executor hears the
        tokens' lookups one token after another, after the step; no look-ahead."""
        pos = np.array([c.pos for c in caches], np.int64)
        if len(caches) == 1:
            return self.run(x, int(pos[0]), caches[0], first, end)
        bank = caches[0].bank if all(c.bank is caches[0].bank for c in caches) else None
        if self._loose[end] == self._loose[first] and bank is not None:
            return self._run_calls(x, caches, pos, first, end)
        told = self.cell.owed = []  # the FFN halves' lookups, told per token after the step
        slots = np.array([c.slot for c in caches], np.int64)
        try:
            for i in range(first, end):
                p = self.layers[i]
                if p.attend is not None and bank is not None:
                    x = torch.from_numpy(p.attend.rows(host_rows(x), *bank.host(i), slots, pos))
                else:
                    x = torch.cat([p.attention(x[t : t + 1], int(pos[t]), c.layers[i]) for t, c in enumerate(caches)])
                x = p.ffn(x)
        finally:
            self.cell.owed = None
        if told:
            _tell_each(self.model.experts, [layer for layer, _ in told], [ids for _, ids in told])
        return x

    def _run_calls(self, x: torch.Tensor, caches: Sequence[KVCache], pos: np.ndarray, first: int,
                   end: int) -> torch.Tensor:  # fmt: skip
        """Every layer's two compiled calls back to back on host rows (one per sequence, each over its slot of one
        bank of caches); then the routing, told once per token. With look-ahead (one token), before each MoE
        layer's call the next MoE layer's experts are predicted, and told with it."""
        h, chosen, moes = host_rows(x), [], []
        ahead, predicted, at = self.prefetch and len(caches) == 1, [], []
        bank, now = caches[0].bank, time.perf_counter
        slots = np.array([c.slot for c in caches], np.int64)
        for i in range(first, end):
            p = self.layers[i]
            attend, ffn = p.calls  # type: ignore[misc]  # (run checked: every layer has them)
            h = attend.rows(h, *bank.host(i), slots, pos)
            if p.moe is None:
                h = ffn(h)  # type: ignore[assignment]
                continue
            if ahead:
                at.append(now())
                predicted.append(p.predict(h) if p.predict is not None and i + 1 < end else None)
            ids, _, h = ffn(h)
            chosen.append(ids)
            moes.append(p.moe)
        if moes:
            experts, layers = self.model.experts, [m.i for m in moes]
            if len(caches) == 1:
                experts.account(layers, chosen, TokenAhead(predicted, at) if ahead else None)
            else:
                _tell_each(experts, layers, chosen)
            for moe, ids in zip(moes, chosen, strict=True):
                moe.remember(torch.from_numpy(ids))
        return torch.from_numpy(h)


def _tell_each(experts: ExpertExecutor, layers: list[int], chosen: list[np.ndarray]) -> None:
    """A step's lookups (each layer's ids [n, k]) told the executor as n tokens, one after another."""
    for t in range(chosen[0].shape[0]):
        experts.account(layers, [ids[t : t + 1] for ids in chosen])


def _predictor(nxt: Block) -> Predict | None:
    """Block `nxt`'s experts predicted from the FFN input of the block before it: its FFN norm and routing; None
    where its FFN is not a MoE layer with a plain top-k routing.

    Without a router bias the norm's division by the row's RMS scales every logit by one positive factor, which
    no gating's order of experts sees: the prediction is the top k of the router times the norm's weights
    (folded once) on the raw row, one product. With a bias, the compiled routing `MoeTokenCall` runs."""
    ffn = nxt.ffn
    if type(ffn) is not MoeFFN or ffn.choice_bias is not None or ffn.cfg.expert_groups != 1:
        return None
    norm, eps, router = nxt.ffn_norm.numpy(), nxt.eps, ffn.router.numpy()
    cfg = ffn.cfg
    k = cfg.n_expert_used
    if ffn.router_bias is None:
        folded = np.ascontiguousarray(router * norm[None, :], dtype=np.float32)  # [n_expert, E]

        def top_k(h: np.ndarray) -> np.ndarray:
            z = folded @ h[0]
            if k == 1:
                return np.array([[int(z.argmax())]], np.int64)
            top = np.argpartition(z, -k)[-k:]
            return top[np.argsort(-z[top], kind="stable")].astype(np.int64).reshape(1, k)

        return top_k
    bias = ffn.router_bias.numpy()
    gating, weights_norm, scale = cfg.expert_gating, cfg.expert_weights_norm, cfg.expert_weights_scale

    def predict(h: np.ndarray) -> np.ndarray:
        return route_rows(rms_rows(h, norm, eps), router, bias, gating, k, weights_norm, scale)[0]

    return predict


def _span(layers: list[int]) -> str:
    """0-11, or 0,4,8 where they are not consecutive."""
    if len(layers) > 1 and layers[-1] - layers[0] + 1 == len(layers):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


# -- attention halves ------------------------------------------------------------------------------


def _attention_call(block: Block, rope: Rope) -> AttentionBlockCall | None:
    """The layer's attention block as one compiled call (on a float32 CPU cache); None where the kernel has no
    form for it: another kind of attention, float or mixed-width matrices, partial biases or QK norms over the
    whole projection, a soft cap."""
    attn = block.attn
    if type(attn) is not Attention or attn.cfg.attn_softcap:
        return None
    ws = (attn.wq, attn.wk, attn.wv, attn.wo)
    norms_fit = attn.qk_norm_per_head or (attn.q_norm is None and attn.k_norm is None)
    biases_fit = (attn.bq is None) == (attn.bk is None) == (attn.bv is None)
    mats = [w for w in ws if isinstance(w, QLinear)]
    if len(mats) != 4 or len({w.bits for w in mats}) != 1 or not (norms_fit and biases_fit):
        return None
    cfg = attn.cfg

    def array(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.numpy()

    return AttentionBlockCall(
        block.attn_norm.numpy(), block.eps, tuple((w.raw, w.qtype) for w in mats),
        tuple(array(b) for b in (attn.bq, attn.bk, attn.bv, attn.bo)), array(attn.q_norm), array(attn.k_norm),
        array(block.post_attn_norm), (cfg.n_head, cfg.n_head_kv[attn.i], cfg.head_dim), rope.parts(), rope.neox,
        attn.window, cfg.head_dim**-0.5, mats[0].bits, array(attn.sinks),
    )  # fmt: skip


def _compiled_attention(call: AttentionBlockCall) -> AttentionHalf:
    def half(x: torch.Tensor, pos0: int, layer: LayerCache) -> torch.Tensor:
        return torch.from_numpy(call(host_rows(x), *host_heads(layer), pos0))

    return half


def _module_attention(block: Block, rope: Rope) -> AttentionHalf:
    def half(x: torch.Tensor, pos0: int, layer: LayerCache) -> torch.Tensor:
        return block.attention_half(x, pos0, layer, rope)

    return half


def _skipped(x: torch.Tensor, pos0: int, layer: LayerCache) -> torch.Tensor:
    return x


# -- FFN halves --------------------------------------------------------------------------------------


def _ffn_half(model: DecoderBase, block: Block,
              cell: AheadCell) -> tuple[FfnHalf, str, MoeTokenCall | FfnBlockCall | None]:  # fmt: skip
    """The layer's FFN half on the CPU, what it is, and the whole half as one call on host rows where it is one."""
    ffn, eps = block.ffn, block.eps
    dense = ffn_call(ffn.gate, ffn.up, ffn.down, ffn.act, norm=block.ffn_norm, eps=eps, post_norm=block.post_ffn_norm,
                     residual=True) if isinstance(ffn, DenseFFN) else None  # fmt: skip
    if dense is not None:
        return _compiled_dense(dense), "compiled", dense
    if isinstance(ffn, MoeFFN) and ffn.i in model.moe_layers:  # (a split model's stage has its own layers' experts)
        whole = ffn.sh_gate is None and block.post_ffn_norm is None  # norm and residual inside the call
        call = moe_token_call(ffn, model.experts, block.ffn_norm if whole else None, eps)
        if call is not None and whole:
            return _compiled_moe(model, ffn, call, cell), "compiled", call
        if call is not None:
            return _routed_call(model, block, ffn, call, cell), "routed call", None
    return _module_ffn(model, block), "module", None


def moe_token_call(ffn: MoeFFN, experts: ExpertExecutor, norm: torch.Tensor | None = None,
                   eps: float = 0.0) -> MoeTokenCall | None:  # fmt: skip
    """One token's routing and routed experts as one compiled call, with `norm` also the FFN's norm before and
    the residual add after; None where the executor offers no such call for the layer (`token_call`) or the
    routing has no compiled form (a choice bias, expert groups). Its caller owes the executor the ids."""
    if type(ffn) is not MoeFFN or ffn.choice_bias is not None or ffn.cfg.expert_groups != 1:
        return None
    bound = experts.token_call(ffn.i)
    if bound is None:
        return None
    cfg = ffn.cfg
    router_bias = None if ffn.router_bias is None else ffn.router_bias.numpy()
    return MoeTokenCall(ffn.router.numpy(), router_bias, cfg.expert_gating, cfg.n_expert_used,
                        cfg.expert_weights_norm, cfg.expert_weights_scale, bound.mats, bound.types, bound.biases,
                        bound.act_code, bound.bits, norm=None if norm is None else norm.numpy(), eps=eps)  # fmt: skip


def _compiled_dense(call: FfnBlockCall) -> FfnHalf:
    def half(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(call(host_rows(x)))

    return half


def _compiled_moe(model: DecoderBase, ffn: MoeFFN, call: MoeTokenCall, cell: AheadCell) -> FfnHalf:
    """x + the routed experts of norm(x), in one call; the executor is told the token's ids (and look-ahead)."""
    layer, experts = ffn.i, model.experts

    def half(x: torch.Tensor) -> torch.Tensor:
        ids, _, y = call(host_rows(x))
        cell.tell(experts, layer, ids)
        ffn.remember(torch.from_numpy(ids))
        return torch.from_numpy(y)

    return half


def _routed_call(model: DecoderBase, block: Block, ffn: MoeFFN, call: MoeTokenCall, cell: AheadCell) -> FfnHalf:
    """The routing and routed experts of norm(x) in one call; the shared expert and post norm as the module has them."""
    layer, experts = ffn.i, model.experts

    def half(x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, block.ffn_norm, block.eps)
        ids, _, routed = call(host_rows(h))
        cell.tell(experts, layer, ids)
        ffn.remember(torch.from_numpy(ids))
        return block.ffn_out(x, ffn.with_shared(h, torch.from_numpy(routed)))

    return half


def _module_ffn(model: DecoderBase, block: Block) -> FfnHalf:
    def half(x: torch.Tensor) -> torch.Tensor:
        return block.ffn_half(x, model.experts)

    return half
