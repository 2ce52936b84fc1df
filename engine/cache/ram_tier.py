"""The RAM tier: experts in slots of our own RAM, read from the model file on a miss.

For a model whose experts do not fit in RAM. The dense weights, norms, embeddings and the KV cache
stay as for any model (the file's map); the experts are never read through the map. Instead each
MoE layer's call (an `ExpertExecutor` call, as the host copy and the device cache take it):

1. looks its experts up in the tier's slots, planned by the engine's own policy (ClassLRU, slot
   groups as the device cache builds them), where a lookup's distinct experts fit in its group;
2. reads the misses from the file into the slots they were given (cache.direct_read: past the page
   cache, several reads in flight), and waits for the reads a prefetch started for its experts;
3. computes every selected expert from the slots with the same kernels and the same rows as the
   host copy (moe.kernel_calls.run_fused, summed in expert order), so nothing it computes changes.

A lookup that selects more distinct experts than its group has slots (a prompt on a small tier)
goes around the policy: what is resident is read from its slot, the rest is read into a scratch
bank for this call only, in runs of consecutive experts (one long read per run and tensor).

Look-ahead: after each block the decoder predicts the next MoE layer's experts with that layer's
router on this block's output (`prefetch`); the predicted misses take slots as demand misses would
and are read on the reader threads while the model computes on, and the lookup waits only for what
is still in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from ..gguf.dequant import dequantize
from ..gguf.direct_read import DirectReader, ReadError
from ..gguf.reader import GGUFFile
from ..kernels.moe_token import TokenExperts
from ..moe.expert_tensors import LayerExperts
from ..moe.host_experts import HostExperts, TokenAhead, Triple, run_experts, sum_parts
from ..moe.kernel_calls import TokenCall, bias_rows, host_arrays, layer_output, run_fused
from .policy import ClassLRU
from .slot_groups import SlotGroup, build_groups, span
from .stats import Counters, CountersSnapshot, TierSnapshot

logger = logging.getLogger(__name__)

KINDS = ("gate", "up", "down")
# Calls of up to this many tokens are predicted and read ahead (decode, not a prompt), one MoE layer ahead
# (`DecoderBase.prefetch_next`). Two or three layers ahead gave a read more time to land, but on the 39 GB
# bench file (2 cores) the extra routing and the wrong guesses' reads cost more than they hid: decode 1.90
# and 2.02 t/s one layer ahead, 1.90 and 1.77 two ahead, 1.77 three ahead (single runs).
PREFETCH_TOKENS = 8


# Part of a layer's experts for `RamTier._compute`: (gate, up, down banks; each expert's slot; its experts, None:
# every selected one).
Part = tuple[tuple[np.ndarray, ...], np.ndarray, "list[int] | None"]


class RamTierError(OSError):
    """An expert that could not be read from the file: the reply ends, the app does not (front ends report
    an OSError as one line)."""


@dataclass
class TierCounters:
    """One layer's RAM tier: lookups planned by the policy, and what went around it or waited."""

    around: Counters = field(default_factory=Counters)  # lookups with more experts than slots
    prefetched: int = 0  # experts read ahead on a prediction
    prefetch_used: int = 0  # of those, selected by the lookup they were read for
    predicted: int = 0  # experts predicted (resident or not)
    predicted_used: int = 0  # predicted experts the layer then selected (the prediction's recall)
    selected: int = 0  # experts the predicted lookups selected
    wait_s: float = 0.0  # seconds the lookups waited for reads


class RamTier:
    """An `ExpertExecutor` over experts held in RAM slots of `mib` MiB, filled from the file."""

    def __init__(self, host: HostExperts, gguf: GGUFFile, n_expert_used: int, mib: float,
                 direct: bool = True, prefetch: bool = True) -> None:  # fmt: skip
        self.host = host
        self.groups = build_groups(host, n_expert_used, mib, 0.0, torch.device("cpu"))
        self.group_of = {layer: g for g in self.groups for layer in g.info.layers}
        # Where each expert's three slices lie: per layer and kind, (shard, offset of expert 0, bytes per expert).
        self._where: dict[int, tuple[tuple[int, int, int], ...]] = {}
        self._names: dict[int, tuple[str, ...]] = {}
        for layer, lx in host.layers.items():
            names = tuple(f"blk.{layer}.ffn_{k}_exps.weight" for k in KINDS)
            infos = [gguf.tensors[n] for n in names]
            self._where[layer] = tuple((t.shard, t.offset, e.bytes_per_expert)
                                       for t, e in zip(infos, (lx.gate, lx.up, lx.down), strict=True))  # fmt: skip
            self._names[layer] = names
        self.reader = DirectReader([gguf.shard_path(i) for i in range(max(t.shard for t in gguf.tensors.values()) + 1)],
                                   direct=direct)  # fmt: skip
        self.prefetch_tokens = PREFETCH_TOKENS if prefetch else 0
        self.counters = {layer: TierCounters() for layer in host.layers}
        self.first_layer = min(host.layers)
        self.tokens = 0  # tokens through the MoE layers
        self._pending: dict[tuple[int, int], list[Future[None]]] = {}  # (group, slot) -> reads in flight
        self._predicted: dict[int, np.ndarray] = {}  # layer -> experts its last prediction named
        self._ahead: tuple[int, torch.Tensor] | None = None  # (layer, ids) handed to `prefetch`, not yet taken
        self._scratch: tuple[np.ndarray, ...] = ()
        self._token_calls: dict[tuple[int, int], TokenExperts] = {}  # per (layer, bits), bound at first use
        self.n_expert_total = sum(lx.gate.raw.shape[0] for lx in host.layers.values())
        self.n_slots = sum(g.policy.n_slots for g in self.groups if g.policy is not None)
        self.slot_bytes = sum(g.info.n_slots * g.info.expert_bytes for g in self.groups)
        for g in self.groups:
            if g.policy is None:
                logger.warning("RAM tier: layers %s have no slots; each lookup reads its experts from the file",
                               span(list(g.info.layers)))  # fmt: skip

    # -- the executor ------------------------------------------------------------------------

    def token_call(self, layer: int) -> TokenCall | None:
        """None: a token's experts must be in RAM before its layer computes, so each layer calls the tier."""
        return None

    def account(self, layers: Sequence[int], ids: Sequence[np.ndarray], ahead: TokenAhead | None = None) -> None:
        """Nothing to account: every lookup came through `__call__`."""

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ids_h = ids.detach().to("cpu", torch.int64).contiguous().numpy()  # [T, k]
        n_tokens = ids_h.shape[0]
        if layer == self.first_layer:
            self.tokens += n_tokens
        group = self.group_of[layer]
        policy = group.policy
        distinct = np.unique(ids_h)
        c = self.counters[layer]
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            c.predicted += predicted.size
            c.selected += distinct.size
            c.predicted_used += int(np.isin(distinct, predicted).sum())
        if policy is not None and distinct.size <= policy.n_slots:
            plan = policy.plan(layer, ids_h.reshape(-1), n_tokens)
            c.prefetch_used += plan.prefetched_hits
            self._fill(group, layer, plan.uploads)
            if self._ahead is not None:  # the next layer's, read while this one waits and computes
                self._take_ahead((layer, distinct))
            if n_tokens == 1 and self.host.fused[layer]:
                return self._token(group, layer, x, ids_h, weights, policy.slot_array(layer), c)
            self._wait(group, policy.slot_array(layer)[distinct].tolist(), c)
            return self._compute(layer, x, ids, weights, [(group.host_banks, policy.slot_array(layer), None)])
        if self._ahead is not None:
            self._take_ahead()
        return self._around(group, layer, x, ids, weights, distinct, n_tokens, c)

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        """Read `layer`'s predicted experts (ids [T, k]) into slots ahead of its lookup, without waiting: right
        after the lookup of the layer before it (its own reads first), or now where that layer has no experts."""
        if self._ahead is not None:
            self._take_ahead()
        self._ahead = (layer, ids)
        if layer - 1 not in self.group_of:
            self._take_ahead()

    def _take_ahead(self, spare: tuple[int, np.ndarray] | None = None) -> None:
        """The prediction `prefetch` kept, read now; never into the slots of `spare` (the lookup just made)."""
        layer, ids = self._ahead  # type: ignore[misc]  # (callers checked)
        self._ahead = None
        group = self.group_of.get(layer)
        if group is None or ids.shape[0] > self.prefetch_tokens:
            return
        predicted = np.unique(ids.detach().cpu().numpy())
        self._predicted[layer] = predicted
        policy = group.policy
        if policy is None or predicted.size > policy.n_slots:
            return
        uploads = policy.prefetch(layer, predicted.tolist(), spare)
        self.counters[layer].prefetched += len(uploads)
        self._fill(group, layer, uploads, ahead=True)

    # -- reads -------------------------------------------------------------------------------

    def _fill(self, group: SlotGroup, layer: int, uploads: Sequence[tuple[int, int]], ahead: bool = False) -> None:
        """Start reading each (expert, slot) of `uploads` from the file into the group's banks."""
        banks = group.host_banks
        for e, s in uploads:
            self._wait(group, (s,), self.counters[layer])  # an earlier read into the slot (an unused guess) lands first
            futures: list[Future[None]] = []
            for bank, (shard, base, n) in zip(banks, self._where[layer], strict=True):
                futures += self.reader.submit(shard, base + e * n, bank[s], self._what(layer, e), ahead)
            self._pending[(group.info.index, s)] = futures

    def _wait(self, group: SlotGroup, slots: Sequence[int], c: TierCounters) -> None:
        """Wait for the reads still in flight into `slots` (a lookup's experts), timing the wait."""
        t = 0.0
        for s in slots:
            futures = self._pending.pop((group.info.index, s), None)
            if futures is not None:
                if not t:
                    t = time.perf_counter()
                self._result(futures)
        if t:
            c.wait_s += time.perf_counter() - t

    def _result(self, futures: list[Future[None]]) -> None:
        try:
            for f in futures:
                f.result()
        except ReadError as e:
            self._forget_all()
            raise RamTierError(str(e)) from None

    def _forget_all(self) -> None:
        """After a failed read a slot may hold part of an expert while the policy says it holds it: every
        slot is forgotten (each group's policy starts empty), so that no later reply computes with it."""
        for futures in self._pending.values():
            for f in futures:
                f.cancel()
        for futures in self._pending.values():
            for f in futures:
                if not f.cancelled():
                    f.exception()  # (waits: no read may land in a slot after this)
        self._pending.clear()
        for g in self.groups:
            if g.policy is not None:
                old = g.policy
                g.policy = ClassLRU(old.layers, old.n_expert, old.n_slots, old.admission)

    def _what(self, layer: int, e: int) -> str:
        return f"experts of layer {layer} (tensors {', '.join(self._names[layer])}), expert {e}"

    def _around(self, group: SlotGroup, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                distinct: np.ndarray, n_tokens: int, c: TierCounters) -> torch.Tensor:  # fmt: skip
        """A lookup with more experts than slots: the resident ones from their slots, the rest read into a
        scratch bank for this call, in runs of consecutive experts; the policy's state stays as it was."""
        policy = group.policy
        slots = policy.slot_array(layer) if policy is not None else None
        resident = [e for e in distinct.tolist() if slots is not None and slots[e] >= 0]
        missing = [e for e in distinct.tolist() if slots is None or slots[e] < 0]
        c.around.calls += 1
        c.around.tokens += n_tokens
        c.around.lookups += distinct.size
        c.around.hits += len(resident)
        c.around.misses += len(missing)
        c.around.uploads += len(missing)
        c.around.uploaded_bytes += len(missing) * group.info.expert_bytes
        scratch = self._scratch_banks(layer, len(missing))
        at = np.full(self.host.layers[layer].gate.raw.shape[0], -1, np.int64)
        futures: list[Future[None]] = []
        runs: list[list[int]] = []
        for e in missing:  # runs of consecutive experts: one read per run and tensor
            if runs and runs[-1][-1] + 1 == e:
                runs[-1].append(e)
            else:
                runs.append([e])
        j = 0
        for run in runs:
            at[run] = np.arange(j, j + len(run))
            for bank, (shard, base, n) in zip(scratch, self._where[layer], strict=True):
                futures += self.reader.submit(shard, base + run[0] * n, bank[j : j + len(run)],
                                              self._what(layer, run[0]))  # fmt: skip
            j += len(run)
        if slots is not None:
            self._wait(group, [int(slots[e]) for e in resident], c)
        t = time.perf_counter()
        self._result(futures)
        c.wait_s += time.perf_counter() - t
        parts: list[Part] = [(scratch, at, missing)]
        if resident and slots is not None:
            parts.append((group.host_banks, slots, resident))
        return self._compute(layer, x, ids, weights, parts)

    def _scratch_banks(self, layer: int, n: int) -> tuple[np.ndarray, ...]:
        """Banks for n experts shaped like `layer`'s, reused from call to call (grown as needed)."""
        lx = self.host.layers[layer]
        shapes = [t.raw.shape[1:] for t in (lx.gate, lx.up, lx.down)]
        have = self._scratch
        if not have or have[0].shape[0] < n or [b.shape[1:] for b in have] != shapes:
            size = max(n, have[0].shape[0] if have else 0)
            self._scratch = tuple(np.empty((size, *s), np.uint8) for s in shapes)
        return self._scratch

    # -- compute -----------------------------------------------------------------------------

    def _token(self, group: SlotGroup, layer: int, x: torch.Tensor, ids: np.ndarray, weights: torch.Tensor,
               slot_of: np.ndarray, c: TierCounters) -> torch.Tensor:  # fmt: skip
        """One token: the experts already in RAM computed while the rest are still being read, then those."""
        key = (layer, self.host.bits)  # (the bits are the host's as they are now: set_bits may change them)
        call = self._token_calls.get(key)
        if call is None:
            lx = self.host.layers[layer]
            types = (lx.gate.qtype, lx.up.qtype, lx.down.qtype)
            biases = (bias_rows(lx.gate.bias), bias_rows(lx.up.bias), bias_rows(lx.down.bias))
            call = self._token_calls[key] = TokenExperts(types, biases, self.host.act_code, self.host.bits)
        slots = slot_of[ids[0]]  # [k]
        index = group.info.index
        waiting = np.array([(index, s) in self._pending for s in slots.tolist()])
        h = x.detach().to("cpu", torch.float32).contiguous().numpy()
        w = weights.detach().to("cpu", torch.float32).contiguous().numpy()
        contrib = np.empty((slots.size, h.shape[1]), np.float32)  # [k, E]: every row gets set
        banks = group.host_banks
        if not waiting.all():
            call(h, ids, w, slots, ~waiting, banks, contrib)
        if waiting.any():
            self._wait(group, slots[waiting].tolist(), c)
            call(h, ids, w, slots, waiting, banks, contrib)
        return layer_output(contrib, ids).to(x.device)

    def _compute(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 parts: list[Part]) -> torch.Tensor:  # fmt: skip
        """The layer's output from banks: each part is (gate, up, down banks; each expert's slot; its experts,
        None for all selected), every pair's row computed as the host copy computes it."""
        lx = self.host.layers[layer]
        if self.host.fused[layer]:
            xh, ih, wh = host_arrays(x, ids, weights)
            contrib = np.empty((ih.size, xh.shape[1]), np.float32)  # [T*k, E]: every row gets set
            bits = self.host.bits_for(xh.shape[0], layer)
            for banks, slot_of, experts in parts:
                gate, up, down = banks
                run_fused(lx, (gate, up, down), slot_of, self.host.act_code, xh, ih, wh, experts, contrib, bits)
            return layer_output(contrib, ih).to(x.device)
        xc, ic, wc = x.cpu(), ids.cpu(), weights.cpu()
        contributions = []
        for banks, slot_of, experts in parts:
            chosen = ic.unique().tolist() if experts is None else experts
            contributions += run_experts(lx, xc, ic, wc, self.host.act, chosen, fetch=_fetch(lx, banks, slot_of))
        return sum_parts(x, contributions)

    # -- what it holds -----------------------------------------------------------------------

    def snapshot(self) -> TierSnapshot:
        lookups = hits = reads = 0
        for g in self.groups:
            if g.policy is None:
                continue
            for layer in g.info.layers:
                small, large = g.policy.counted(layer, g.info.expert_bytes)
                both: CountersSnapshot = small + large
                lookups += both.lookups
                hits += both.hits
                reads += both.uploads
        cs = self.counters.values()
        return TierSnapshot(
            self.n_slots, self.n_expert_total, self.slot_bytes,
            lookups + sum(c.around.lookups for c in cs), hits + sum(c.around.hits for c in cs),
            reads + sum(c.around.uploads for c in cs), sum(c.prefetched for c in cs),
            sum(c.prefetch_used for c in cs), sum(c.predicted for c in cs), sum(c.predicted_used for c in cs),
            sum(c.selected for c in cs), self.reader.bytes_read, sum(c.wait_s for c in cs),
        )  # fmt: skip

    def close(self) -> None:
        for futures in self._pending.values():
            for f in futures:
                f.cancel()
        self._pending.clear()
        self.reader.close()


def _fetch(lx: LayerExperts, banks: tuple[np.ndarray, ...], slot_of: np.ndarray) -> Callable[[int], Triple]:
    """Exact path: expert e's dequantized (gate, up, down) from its slot in `banks`."""
    tensors = (lx.gate, lx.up, lx.down)

    def fetch(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = int(slot_of[e])
        g, u, d = (dequantize(torch.from_numpy(b[s]), t.qtype) for b, t in zip(banks, tensors, strict=True))
        return g, u, d

    return fetch
