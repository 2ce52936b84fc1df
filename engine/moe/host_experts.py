"""The MoE block, split so that the expert cache can slot in behind one interface.

router -> (ids, weights) per token -> expert execution -> weighted sum (+ shared expert).

`ExpertExecutor` is that interface: given a layer, the hidden states and the selected ids and
weights, it returns the weighted sum of the selected experts' outputs. `HostExperts` reads
the experts straight from the file's quantized bytes: by default with the fused kernels
(fused_moe), else (exact path) dequantizing only the selected ones, never the whole layer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ParameterError
from ..kernels import cpu as cpu_kernels
from ..kernels.codes import GEMM_TOKENS
from ..kernels.isa import activation_bits
from ..kernels.modes import KERNEL_MODES
from ..nn.activations import Activation, activation_code
from .expert_tensors import ExpertTensor, LayerExperts
from .kernel_calls import TokenCall, bias_rows, fusable, host_arrays, layer_output, run_fused


def _nbytes(w: torch.Tensor) -> int:
    return int(w.numel() * w.element_size())


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: Activation,
               biases: tuple[torch.Tensor | None, ...] = (None, None, None)) -> torch.Tensor:  # fmt: skip
    """One expert on the rows routed to it: x [n, E] -> [n, E]."""
    g = F.linear(x, gate, biases[0])
    u = F.linear(x, up, biases[1])
    return F.linear(act(g, u), down, biases[2])


@dataclass(frozen=True)
class TokenAhead:
    """A decode token's look-ahead, told with its lookups (`ExpertExecutor.account`): per MoE layer of the token,
    in order, the experts predicted for the block after it ([1, k]; None: none), made from this layer's FFN input
    as its lookup came, and the clock's time then (time.perf_counter)."""

    predicted: Sequence[np.ndarray | None]
    at: Sequence[float]


class ExpertExecutor(Protocol):
    """How a model's routed experts run: a call per MoE layer, and for a decode token, where the executor
    offers it, one compiled call per layer that routes and runs the experts (`token_call`), after which
    the token's ids are handed back (`account`) for what the executor keeps (the cache's lookups).

    Look-ahead: for steps of at most `prefetch_tokens` tokens (0: never) the model predicts each MoE layer's
    experts from the FFN input of the block before it (the layer's own norm and router on that hidden state)
    and hands them to `prefetch` before that block's lookup, or, for token calls, to `account` with the
    lookups: fetched while the block before computes."""

    prefetch_tokens: int

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, E], ids/weights [T, k] -> sum over k of weight * expert(x) [T, E]."""
        ...

    def token_call(self, layer: int) -> TokenCall | None:
        """What `kernels.moe_token` binds of the layer's experts for one token; None: the layer has none."""
        ...

    def account(self, layers: Sequence[int], ids: Sequence[np.ndarray], ahead: TokenAhead | None = None) -> None:
        """After one token ran through `layers`' token calls (in order): each layer's ids [1, k]."""
        ...

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        """`layer`'s experts predicted (ids [T, k]) from the block before it, before that block's lookup: the
        executor takes them after that lookup (or at `layer`'s, where the block before has no experts)."""
        ...


Contribution = tuple[int, torch.Tensor, torch.Tensor]  # (expert, token rows, weighted output rows)


Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DequantCache:
    """Dequantized (gate, up, down) of recently used experts, least recently used dropped past a byte budget.

    Exact path only (`--cpu-kernels exact`): dequantizing is most of an expert's time there, and a
    hot expert kept in fp32 skips it. The values are the exact dequantizer's, so results do not
    change. It costs 4 bytes per weight (7 to 14 times the quantized size): `--cpu-dequant-mib`,
    off by default.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self.items: OrderedDict[tuple[int, int], Triple] = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # the CPU-share worker and the main path both use it

    def get(self, key: tuple[int, int], make: Callable[[], Triple]) -> Triple:
        with self._lock:
            got = self.items.get(key)
            if got is not None:
                self.items.move_to_end(key)
                self.hits += 1
                return got
        value = make()
        size = sum(_nbytes(t) for t in value)
        with self._lock:
            self.misses += 1
            if size <= self.budget and key not in self.items:
                self.items[key] = value
                self.used += size
                while self.used > self.budget:
                    _, old = self.items.popitem(last=False)
                    self.used -= sum(_nbytes(t) for t in old)
        return value


class HostExperts:
    """Expert execution straight from the host copy (the file's bytes).

    `kernels="fast"`, `"int16"` or `"int8"`: the layer's selected experts in three kernel calls that read the
    quantized blocks in place (fused_moe); layers whose types or activation have no kernel, and
    `kernels="exact"`, dequantize each selected expert with torch and multiply in float32 (the
    reference path), optionally keeping up to `dequant_mib` of dequantized experts.
    """

    def __init__(
        self, layers: dict[int, LayerExperts], act: Activation, *, kernels: str = "fast", dequant_mib: float = 0.0
    ) -> None:
        if kernels not in KERNEL_MODES:
            modes = ", ".join(KERNEL_MODES)
            raise ParameterError("kernels", f"the CPU kernels must be one of {modes}, got '{kernels}'")
        if dequant_mib < 0:
            raise ParameterError("dequant_mib", f"the dequantized experts' budget must be >= 0 MiB, got {dequant_mib}")
        self.layers = layers
        self.act = act
        self.kernels = kernels
        self.dequant_mib = dequant_mib
        self.dequant = DequantCache(int(dequant_mib * 2**20)) if dequant_mib > 0 else None
        code = activation_code(act)
        self.act_code = -1 if code is None else code
        self.fused = {i: kernels != "exact" and fusable(lx, act) for i, lx in layers.items()}
        self.prefetch_tokens = 0  # nothing to fetch: every expert is here
        # The fused kernels' activations: `bits` for a few tokens (decode); for a prompt, `prompt_bits`
        # where the integer tiles read a matrix, else `prompt_rows_bits` (kernels.isa.Widths).
        self.bits, self.prompt_bits, self.prompt_rows_bits = activation_bits(kernels)
        self._token_calls: dict[int, TokenCall] = {}

    def set_bits(self, bits: int, prompt_bits: int, prompt_rows_bits: int | None = None) -> None:
        """The activations' bits for a few tokens and for a prompt (`kernels.isa.activation_bits`;
        `prompt_rows_bits` defaults to `prompt_bits`)."""
        self.bits, self.prompt_bits = bits, prompt_bits
        self.prompt_rows_bits = prompt_bits if prompt_rows_bits is None else prompt_rows_bits
        self._token_calls.clear()  # they hold the bits

    def bits_for(self, n_tokens: int, layer: int) -> tuple[int, int]:
        """The activations' bits of a call on n_tokens rows of a layer, (gate and up, down): the same
        rule wherever the experts run."""
        if n_tokens < GEMM_TOKENS:
            return self.bits, self.bits
        lx = self.layers[layer]
        return self._prompt_width(lx.gate, lx.up), self._prompt_width(lx.down)

    def _prompt_width(self, *ts: ExpertTensor) -> int:
        """A prompt's bits for matrices run in one kernel: the tiles' where they read all of them."""
        tiles = all(cpu_kernels.tiles_read(t.qtype, t.cols, self.prompt_bits) for t in ts)
        return self.prompt_bits if tiles else self.prompt_rows_bits

    def token_call(self, layer: int) -> TokenCall | None:
        """What `kernels.moe_token` takes of this layer's experts (None: no fused kernels for it)."""
        if not self.fused[layer]:
            return None
        call = self._token_calls.get(layer)
        if call is None:
            lx = self.layers[layer]
            types = (lx.gate.qtype, lx.up.qtype, lx.down.qtype)
            biases = (bias_rows(lx.gate.bias), bias_rows(lx.up.bias), bias_rows(lx.down.bias))
            call = self._token_calls[layer] = TokenCall(self.mats(layer), types, biases, self.act_code, self.bits)
        return call

    def account(self, layers: Sequence[int], ids: Sequence[np.ndarray], ahead: TokenAhead | None = None) -> None:
        """The host copy keeps nothing of a token's routing."""

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        """Never called: the host copy asks for no predictions (`prefetch_tokens` 0)."""

    def with_layers(self, layers: dict[int, LayerExperts]) -> HostExperts:
        """The same execution options over other copies of the experts (pinned memory)."""
        other = HostExperts(layers, self.act, kernels=self.kernels, dequant_mib=self.dequant_mib)
        other.set_bits(self.bits, self.prompt_bits, self.prompt_rows_bits)
        return other

    def mats(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lx = self.layers[layer]
        return lx.gate.raw.numpy(), lx.up.raw.numpy(), lx.down.raw.numpy()

    def fetcher(self, layer: int) -> Callable[[int], Triple] | None:
        """How exact-path CPU code gets an expert's fp32 matrices: through the dequant cache when there is one."""
        cache = self.dequant
        if cache is None:
            return None
        lx = self.layers[layer]
        return lambda e: cache.get((layer, e), lambda: (lx.gate.expert(e), lx.up.expert(e), lx.down.expert(e)))

    def run_host_part(
        self,
        layer: int,
        x: np.ndarray,
        ids: np.ndarray,
        w: np.ndarray,
        experts: Sequence[int] | np.ndarray | None,
        contrib: np.ndarray,
    ) -> None:
        """Fused path: the contributions of `experts` (None: all selected), from the host copy, into their rows."""
        run_fused(
            self.layers[layer],
            self.mats(layer),
            None,
            self.act_code,
            x,
            ids,
            w,
            experts,
            contrib,
            self.bits_for(x.shape[0], layer),
        )

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.fused[layer]:
            xh, ih, wh = host_arrays(x, ids, weights)
            contrib = np.empty((ih.size, xh.shape[1]), np.float32)  # [T*k, E]: every row gets set
            self.run_host_part(layer, xh, ih, wh, None, contrib)
            return layer_output(contrib, ih).to(x.device)
        # The experts live in host memory and run there; x may be on a device.
        xc, ic, wc = x.cpu(), ids.cpu(), weights.cpu()
        parts = run_experts(self.layers[layer], xc, ic, wc, self.act, ic.unique().tolist(), fetch=self.fetcher(layer))
        return sum_parts(x, parts)


def run_experts(
    lx: LayerExperts,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    act: Activation,
    experts: list[int],
    fetch: Callable[[int], Triple] | None = None,
) -> list[Contribution]:
    """Weighted outputs of `experts` (a subset of those in `ids`) for the tokens routed to them.

    `fetch(e)` gives the dequantized (gate, up, down) of expert e; by default the host copy.
    `ids` may live on the host while x is on a device: the row lookup then needs no device sync.
    """
    parts: list[Contribution] = []
    # Decode (one token, ids on the host): no row lookups, so no nonzero and no gathers per
    # expert (measurable at 270 experts per token on the demo); the arithmetic is the same.
    row = ids[0].tolist() if x.shape[0] == 1 and ids.device.type == "cpu" else None
    only = torch.zeros(1, dtype=torch.long, device=x.device)
    for e in experts:
        if row is not None:
            j = row.index(e)
            tok, xe, w = only, x, weights[:, j : j + 1]
        else:
            tok, slot = (ids == e).nonzero(as_tuple=True)  # rows routed to e
            if tok.device != x.device:
                tok, slot = tok.to(x.device, non_blocking=True), slot.to(x.device, non_blocking=True)
            xe, w = x[tok], weights[tok, slot].unsqueeze(-1)
        gate, up, down = fetch(e) if fetch is not None else (lx.gate.expert(e), lx.up.expert(e), lx.down.expert(e))
        biases = tuple(t.bias[e] if t.bias is not None else None for t in (lx.gate, lx.up, lx.down))
        parts.append((e, tok, expert_ffn(xe, gate, up, down, act, biases) * w))
    return parts


def sum_parts(x: torch.Tensor, parts: list[Contribution]) -> torch.Tensor:
    """Sum the contributions in expert order, so where each expert ran never changes the result."""
    out = torch.zeros_like(x)
    for _, tok, y in sorted(parts, key=lambda p: p[0]):
        out.index_add_(0, tok.to(out.device), y.to(out.device))
    return out
