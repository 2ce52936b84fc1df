"""The device expert cache: slots on the device, misses uploaded or computed on the CPU.

`ExpertCache` is an `ExpertExecutor`: the MoE block calls it exactly as it calls the host
experts. Per call (one MoE layer, one batch):

1. the policy (`cache_policy.ClassLRU`, shared with the simulator) plans the lookup: hits,
   misses to upload into victim slots, misses left to the CPU;
2. the CPU part starts on a worker thread, reading the host copy;
3. uploads copy the host bytes into the slots (runs of consecutive experts and slots in one
   copy; with an emulated link each upload also costs bytes / link speed);
4. the device computes the hits and the uploaded experts from the slots;
5. the contributions are summed in expert order, so the result does not depend on where
   each expert ran.

Batches of more than `max_batch` tokens (prefill), and lookups that could select more experts
than the group has slots, bypass the cache: they read the experts from the host and leave the
cache state as it was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..gguf.dequant import dequantize
from ..kernels import device as device_kernels
from ..kernels.jit import set_kernel_threads
from ..moe.expert_tensors import LayerExperts
from ..moe.host_experts import Contribution, HostExperts, TokenAhead, run_experts, sum_parts
from ..moe.kernel_calls import TokenCall, host_arrays, layer_output, run_fused
from . import warm_start
from .device_memory import pinned
from .lookup_log import RECORD, LookupLog
from .policy import ClassLRU, CpuShare, bypasses, count_bypass, count_prediction, count_prefetch
from .rules import LOGGED
from .settings import CacheSettings
from .slot_groups import SlotGroup, build_groups
from .stats import LayerCounters, LayerSnapshot, StatsSnapshot
from .trace import TraceWriter
from .uploads import Uploader

logger = logging.getLogger(__name__)


CachedPath = Callable[[int, SlotGroup, ClassLRU, LayerExperts, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PREFETCHED_HITS = LOGGED - 1  # the bits of a step's result that count hits on prefetched experts


class ExpertCache:
    def __init__(self, host: HostExperts, n_expert_used: int, settings: CacheSettings) -> None:
        settings.validate()
        self.settings = settings
        self.device = torch.device(settings.device)
        self.host = pinned(host) if settings.load_mode == "pinned" and self.device.type == "cuda" else host
        if settings.load_mode == "pinned" and self.device.type != "cuda":
            logger.info("the pinned load mode only matters with a CUDA device; experts stay memory-mapped")
        self.uploader = Uploader(self.device, settings.emulate_link_gbps)
        # The decoder predicts each next MoE layer's experts for calls of up to this many tokens (0: never):
        # to fetch them ahead, or only to write them to the trace, which replays prefetch at any size.
        self.prefetch_tokens = settings.max_batch if settings.fetch_ahead or settings.trace else 0
        self._predicted: dict[int, np.ndarray] = {}  # layer -> its last prediction, until its lookup
        self._ahead: tuple[int, torch.Tensor] | None = None  # (layer, ids) handed to `prefetch`, not yet taken
        self.n_expert_used = n_expert_used
        self.share = CpuShare(settings.cpu_share)
        # On the CPU device without an emulated link a slot is the host copy itself: an upload would copy
        # bytes to where they already are. Its slots then hold no bytes of their own (no banks), the
        # kernels read the expert in place, and the counters count the upload as on a device.
        self.in_place = self.device.type == "cpu" and settings.device_kernels != "triton"
        self.groups = build_groups(self.host, n_expert_used, settings.mib, settings.cpu_share, self.device,
                                   settings.policy, allocate=not self.in_place)  # fmt: skip
        self.group_of = {layer: g for g in self.groups for layer in g.info.layers}
        self.stats = {layer: LayerCounters() for layer in host.layers}
        self.use_counts = {layer: [0] * lx.gate.raw.shape[0] for layer, lx in host.layers.items()}
        self.first_layer = min(host.layers)
        self.tokens = 0
        # The CPU computes the share's misses, and those the policy does not admit: with a device, on
        # one worker with one intra-op thread beside the main thread, which drives the device (two
        # teams of intra-op threads on a small machine only oversubscribe it; the setting is per
        # thread). On the CPU device that part runs inline: the device is the same cores.
        to_cpu = (self.share.q or settings.policy != "classlru") and self.device.type != "cpu"
        self._worker = (
            ThreadPoolExecutor(1, thread_name_prefix="moechat-cpu", initializer=_one_thread) if to_cpu else None
        )
        self._lock = threading.Lock()  # guards the counters while a snapshot is taken
        self.warm_counts: warm_start.Counts | None = None
        # (layer, expert) the warm start put in slots, before the first token
        self.preloaded: list[tuple[int, int]] = []
        self.warm_bytes = 0
        if settings.warm_start is not None:
            n_expert = {layer: lx.gate.raw.shape[0] for layer, lx in self.host.layers.items()}
            self.warm_counts = warm_start.read(settings.warm_start, n_expert)
            if self.warm_counts is not None:
                self._preload(self.warm_counts)
        # The recent cacheable lookups, which the app replays through MIN after a reply (the bound at
        # this size): a bounded window, from the slots as they were at its start.
        self.log = LookupLog(self.preloaded, len(host.layers) * (RECORD + n_expert_used), settings.max_batch)
        for g in self.groups:
            if g.policy is not None:
                g.policy.set_share(self.share)
        self._trace = TraceWriter(settings.trace, self._trace_header()) if settings.trace else None
        self._biases: dict[int, tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]] = {}
        self.triton = {layer: self._use_triton(layer, lx) for layer, lx in self.host.layers.items()}
        # How each layer runs, chosen once: its planned lookups (hits, uploads and the CPU's part), and
        # a batch that goes around the cache (prefill, or a layer without slots).
        self._cached_path = {layer: self._cached_path_for(layer) for layer in self.host.layers}
        self._uncached_path = self.host if self.device.type == "cpu" else self._run_uncached_on_device
        # Where the slots are the host copy, a decode token's layer computes exactly what the host copy's
        # one-call token kernel computes, whatever the plan: the decoder runs those calls (`token_call`)
        # and tells the cache the token's lookups afterwards, all layers at once (`account`), which also
        # writes them to the trace; a prefetch's predictions come with them (`TokenAhead`), and an emulated
        # link's time is told in the order it ran. Not where a group's slots could be outnumbered by a token's
        # experts.
        self.per_token = self.in_place and all(
            g.policy is not None and not bypasses(1, n_expert_used, g.info.n_expert, g.policy.n_slots,
                                                  settings.max_batch) for g in self.groups)  # fmt: skip
        self.last_layer = max(host.layers)
        self._owed_layers: list[int] = []
        self._owed_ids: list[np.ndarray] = []
        self._owed_ahead: list[np.ndarray | None] = []  # with look-ahead: each owed row's prediction, and when
        self._owed_at: list[float] = []
        self._ahead_res = np.zeros((len(host.layers), 4), np.int64)
        self._token_runs: dict[tuple[int, ...], list[tuple[tuple[Any, ...], np.ndarray, int, int, int]]] = {}
        self._token_res = np.zeros((len(host.layers), 3), np.int64)  # each row's result, hits, uploads

    @property
    def warm_uploads(self) -> int:
        """Slots filled from the saved counts before the first token."""
        return len(self.preloaded)

    def _cached_path_for(self, layer: int) -> CachedPath:
        if self.triton[layer]:
            return self._run_triton
        if self.device.type == "cpu" and self.host.fused[layer]:
            return self._run_fused
        return self._run_exact

    def _use_triton(self, layer: int, lx: LayerExperts) -> bool:
        want = self.settings.device_kernels
        if want == "torch" or (want == "auto" and self.device.type != "cuda"):
            return False
        qtypes = (lx.gate.qtype, lx.up.qtype, lx.down.qtype)
        if device_kernels.supports(qtypes) and self.host.act_code >= 0:
            return True
        why = "triton is not installed" if not device_kernels.available() else (
            f"no device kernel for {'/'.join(t.name for t in qtypes)} or this activation")  # fmt: skip
        logger.info("MoE layer %d: %s; its cached experts are dequantized on each use", layer, why)
        return False

    # -- set-up --------------------------------------------------------------------------

    def _preload(self, counts: warm_start.Counts) -> None:
        """Fill each group's slots with the hottest saved experts (the simulator does the same)."""
        for group in self.groups:
            if group.policy is None:
                continue
            placed = group.policy.preload(warm_start.hottest(counts, group.info.layers, group.policy.n_slots))
            for layer in group.info.layers:
                uploads = tuple(sorted((e, slot) for lay, e, slot in placed if lay == layer))
                self.uploader.upload(group, self.host.layers[layer], uploads)
            self.preloaded += [(lay, e) for lay, e, _ in placed]
            self.warm_bytes += len(placed) * group.info.expert_bytes
        logger.info("warm start: %d experts (%.1f MiB) in their slots before the first token", self.warm_uploads,
                    self.warm_bytes / 2**20)  # fmt: skip

    def save_warm_start(self) -> None:
        """Write the experts' decayed use counts for the next run (layers no slot group covers keep the old)."""
        self._settled()
        if self.settings.warm_start is None:
            return
        counts = dict(self.warm_counts or {})
        for group in self.groups:
            if group.policy is not None:
                for layer in group.info.layers:
                    counts[layer] = group.policy.decayed_crf(layer)
        if counts:
            warm_start.write(self.settings.warm_start, counts)

    def _trace_header(self) -> dict[str, object]:
        return {
            "version": 1,
            "max_batch": self.settings.max_batch,
            "n_expert_used": self.n_expert_used,
            "budget_mib": self.settings.mib,
            "cpu_share": self.settings.cpu_share,
            "policy": self.settings.policy,
            "prefetch": self.settings.fetch_ahead,
            "predictions": True,  # every MoE layer's prediction one layer ahead, whether fetched or not
            "groups": [
                {
                    "layers": list(g.info.layers),
                    "n_expert": g.info.n_expert,
                    "expert_bytes": g.info.expert_bytes,
                    "n_slots": g.info.n_slots,
                    "budget_bytes": g.info.budget_bytes,
                }
                for g in self.groups
            ],
            # The saved counts the slots were filled from: a replay fills its slots the same way.
            "warm": {str(k): v for k, v in self.warm_counts.items()} if self.warm_counts is not None else None,
        }

    # -- execution -------------------------------------------------------------------------

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # At every MoE layer of every token: as few steps as possible, the policy's whole lookup (its
        # counters and the lookup log included) in one compiled call.
        if self._owed_layers:  # (inline: this runs at every layer of the general path)
            self._settle()
        if ids.device.type != "cpu":
            ids = ids.cpu()  # the one host sync the routing needs
        ids_h = ids.numpy()  # [T, k] int64
        n_tokens, n_used = ids_h.shape
        flat_ids = ids_h.reshape(-1)  # [T*k], what the compiled policy reads
        if self._trace is not None:
            self._trace.write(layer, n_used, flat_ids)
        if layer == self.first_layer:
            self.log.tick(n_tokens, self._slot_contents)
            self.tokens += n_tokens
        if self._predicted:
            predicted = self._predicted.pop(layer, None)
            if predicted is not None:
                with self._lock:
                    count_prediction(self.stats[layer].of(n_tokens), predicted, flat_ids)
        group = self.group_of[layer]
        policy = group.policy
        if policy is None or (
            (n_tokens > self.settings.max_batch or n_tokens * n_used > policy.n_slots)
            and bypasses(n_tokens, n_used, group.info.n_expert, policy.n_slots, self.settings.max_batch)
        ):
            if self._ahead is not None:
                self._take_ahead()
            return self._around(layer, x, ids, weights, flat_ids, n_tokens, n_used, group.info.expert_bytes)
        with self._lock:
            r = policy.step(layer, flat_ids, n_tokens, self.log.buf)
        if r < 0:
            raise policy.refused(layer, r)
        if not r & LOGGED:
            self.log.add(layer, n_used, flat_ids, policy.last_plan().n_hits)
        if r & PREFETCHED_HITS:
            self.uploader.wait_ahead()  # experts a prefetch uploaded are read now: their copies must be in
        if self._ahead is not None:  # the next layer's, uploaded while this one computes (its slots spared)
            self._take_ahead((layer, flat_ids))
        return self._cached_path[layer](layer, group, policy, self.host.layers[layer], x, ids, weights)

    def token_call(self, layer: int) -> TokenCall | None:
        """The host copy's one-token call for `layer` where the cache lets a token run as one (`per_token`);
        whoever runs it owes the cache the token's lookups (`account`)."""
        return self.host.token_call(layer) if self.per_token else None

    def account(self, layers: Sequence[int], ids: Sequence[np.ndarray], ahead: TokenAhead | None = None) -> None:
        """Lookups of a decode token whose MoE `layers` (in order) ran as token calls, each layer's ids
        [1, k]. They are kept until the token's last MoE layer is told (or anything else reads or steps
        the cache), then stepped through the policy as `__call__` steps them, counters and lookup log
        included, in one compiled call a group (`_settle`). With the token's look-ahead (`ahead`), each
        layer's prediction goes first, as `prefetch` and `__call__` would have run them (`_settle_ahead`)."""
        if ahead is not None:
            self._owed_ahead.extend(ahead.predicted)
            self._owed_at.extend(ahead.at)
        self._owed_layers.extend(layers)
        self._owed_ids.extend(ids)
        if layers[-1] == self.last_layer:
            self._settle()

    def _settle(self) -> None:
        """Step the lookups `account` holds; on an emulated link the device then waits for the uploads' time."""
        if self._owed_at:
            self._settle_ahead_owed()
            return
        key = tuple(self._owed_layers)
        rows = np.concatenate(self._owed_ids)  # [n, k]
        self._owed_layers.clear()
        self._owed_ids.clear()
        if self._trace is not None:  # each layer's record, in the order `__call__` would have written them
            for layer, row in zip(key, rows, strict=True):
                self._trace.write(layer, row.shape[0], row)
        if key[0] == self.first_layer:
            self.log.tick(1, self._slot_contents)
            self.tokens += 1
        runs = self._token_runs.get(key)
        if runs is None:
            runs = self._token_runs[key] = self._runs_of(key)
        res = self._token_res
        if res.shape[0] < len(key):
            res = self._token_res = np.zeros((len(key), 3), np.int64)
        moved = 0
        with self._lock:
            for (step, st, fl, out), at, lo, hi, expert_bytes in runs:
                whole = lo == 0 and hi == len(key)  # one group: no slices to make
                n = step(st, fl, at, rows if whole else rows[lo:hi], out, self.log.buf, res if whole else res[lo:hi])
                if n < 0:
                    n = self._unsettled(key, rows, lo, hi)
                moved += n * expert_bytes
        if moved and self.uploader.link_gbps:
            self.uploader.carried(moved)

    def _settle_ahead_owed(self) -> None:
        """The lookups and predictions `account` holds, stepped: in one compiled call where one group holds every
        layer (`ClassLRU.step_token_ahead`), else layer by layer (`_settle_ahead`)."""
        layers, ids = list(self._owed_layers), list(self._owed_ids)
        ahead = TokenAhead(list(self._owed_ahead), list(self._owed_at))
        for owed in (self._owed_layers, self._owed_ids, self._owed_ahead, self._owed_at):
            owed.clear()
        if len(self.groups) != 1 or len(layers) != len(ahead.at):
            self._settle_ahead(layers, ids, ahead)
            return
        group = self.groups[0]
        policy = group.policy
        assert policy is not None  # (per_token: every group has slots)
        if layers[0] == self.first_layer:
            self.log.tick(1, self._slot_contents)
            self.tokens += 1
        rows = np.concatenate(ids)  # [n, k]
        n, k = rows.shape
        preds = np.full((n, k), -1, np.int64)
        for i, p in enumerate(ahead.predicted):
            if p is not None and layers[i] + 1 in self.group_of:
                preds[i, : p.size] = p.reshape(-1)
        res = self._ahead_res if self._ahead_res.shape[0] >= n else np.zeros((n, 4), np.int64)
        fetch = self.settings.fetch_ahead
        with self._lock:
            r = policy.step_token_ahead(np.asarray(layers, np.int64), rows, preds, fetch, self.log.buf, res)
        eb, link, trace, stats = group.info.expert_bytes, self.uploader, self._trace, self.stats
        for i, layer in enumerate(layers):
            result, n_hits = int(res[i, 0]), int(res[i, 1])
            if result < 0:
                raise policy.refused(layer, result)
            row = rows[i]
            if r < 0 and not result & LOGGED:
                self.log.add(layer, k, row, n_hits)
            if trace is not None:
                trace.write(layer, k, row)
            seen = self._predicted.pop(layer, None)
            if seen is not None:
                count_prediction(stats[layer].small, seen, row)
            if link.link_gbps:
                if res[i, 2]:
                    link.told(int(res[i, 2]) * eb, ahead.at[i], ahead=False)
                elif result & PREFETCHED_HITS:
                    link.waited(ahead.at[i])
            if preds[i, 0] >= 0:
                nxt = layer + 1
                self._predicted[nxt] = preds[i]
                if trace is not None:
                    trace.write(-1 - nxt, k, preds[i])
                if fetch:
                    count_prefetch(stats[nxt].small, int(res[i, 3]), eb)
                    link.told(int(res[i, 3]) * eb, ahead.at[i], ahead=True)
        link.pay()

    def _settle_ahead(self, layers: Sequence[int], rows: Sequence[np.ndarray], ahead: TokenAhead) -> None:
        """A decode token's lookups and predictions, layer by layer in the order they ran: each lookup as
        `__call__` steps it, then the next layer's prediction as `prefetch` takes it; on an emulated link each
        upload at the time it was asked for (a prefetch's while the device went on, a demand miss's with the
        device waiting), the device's wait paid once, at the end."""
        if layers[0] == self.first_layer:
            self.log.tick(1, self._slot_contents)
            self.tokens += 1
        link, trace = self.uploader, self._trace
        for layer, ids, predicted, at in zip(layers, rows, ahead.predicted, ahead.at, strict=True):
            group = self.group_of[layer]
            policy = group.policy
            assert policy is not None  # (per_token: every group has slots)
            flat = ids.reshape(-1)
            if trace is not None:
                trace.write(layer, flat.size, flat)
            seen = self._predicted.pop(layer, None)
            with self._lock:
                if seen is not None:
                    count_prediction(self.stats[layer].small, seen, flat)
                r = policy.step(layer, flat, 1, self.log.buf)
            if r < 0:
                raise policy.refused(layer, r)
            n_hits, n_uploads = policy.last_counts()
            if not r & LOGGED:
                self.log.add(layer, flat.size, flat, n_hits)
            if n_uploads:
                link.told(n_uploads * group.info.expert_bytes, at, ahead=False)
            elif r & PREFETCHED_HITS:
                link.waited(at)
            if predicted is not None:
                self._ahead_now(layer + 1, predicted.reshape(-1), 1, predicted.shape[-1], at, (layer, flat))
            elif self._ahead is not None:
                self._take_ahead((layer, flat))
        link.pay()

    def _unsettled(self, key: tuple[int, ...], rows: np.ndarray, lo: int, hi: int) -> int:
        """A run of `_settle` that did not end clean: a refused lookup raises; lookups the log had no room
        for go in as it grows. Returns the run's uploads."""
        res = self._token_res
        for i in range(lo, hi):
            r = int(res[i, 0])
            if r < 0:
                policy = self.group_of[key[i]].policy
                assert policy is not None  # (_runs_of checked)
                raise policy.refused(key[i], r)
            if not r & LOGGED:
                self.log.add(key[i], rows.shape[1], rows[i], int(res[i, 1]))
        return int(res[lo:hi, 2].sum())

    def _runs_of(self, layers: tuple[int, ...]) -> list[tuple[tuple[Any, ...], np.ndarray, int, int, int]]:
        """Consecutive rows of `layers` whose layers share a slot group: (its policy's stepper, the rows'
        layers, first row, end, expert bytes)."""
        runs: list[tuple[ClassLRU, int, int, int]] = []
        for i, layer in enumerate(layers):
            group = self.group_of[layer]
            policy = group.policy
            if policy is None:
                raise ValueError(f"layer {layer} has no slots: its tokens cannot be accounted")
            if runs and runs[-1][0] is policy:
                runs[-1] = (policy, runs[-1][1], i + 1, runs[-1][3])
            else:
                runs.append((policy, i, i + 1, group.info.expert_bytes))
        return [(p.token_stepper(), np.asarray(layers[lo:hi], np.int64), lo, hi, b) for p, lo, hi, b in runs]

    def _settled(self) -> None:
        """Before anything else steps or reads the cache: the lookups `account` still holds, stepped."""
        if self._owed_layers:
            self._settle()

    def _around(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, flat_ids: np.ndarray,
                n_tokens: int, n_used: int, expert_bytes: int) -> torch.Tensor:  # fmt: skip
        """A lookup that goes around the cache: counted, its uses too, and the experts read from the host."""
        flat = flat_ids.tolist()
        layer_stats = self.stats[layer]
        with self._lock:
            count_bypass(layer_stats.of(n_tokens), n_tokens, len(set(flat)), expert_bytes)
            uses = self.use_counts[layer]  # a planned lookup's uses the policy counts (ClassLRU.uses)
            for e in flat:
                uses[e] += 1
        if n_tokens <= self.settings.max_batch:
            self.log.add(layer, n_used, flat, -1)
        return self._uncached_path(layer, x, ids, weights)

    def lookups(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """The cacheable lookups of the MIN window (the session's, while it is shorter), in order:
        (layer, experts per token, ids token-major)."""
        return list(self.log.window().records)

    def _uses(self, layer: int, policy: ClassLRU | None) -> tuple[int, ...]:
        """Each expert's selections since the cache was made: the lookups it planned, and those around it."""
        around = self.use_counts[layer]
        if policy is None:
            return tuple(around)
        return tuple(int(a) + b for a, b in zip(policy.uses(layer).tolist(), around, strict=True))

    def _slot_contents(self) -> tuple[tuple[int, int], ...]:
        """(layer, expert) of every filled slot, group by group."""
        held: list[tuple[int, int]] = []
        for g in self.groups:
            if g.policy is not None:
                n_expert = g.policy.n_expert
                held += [(int(k) // n_expert, int(k) % n_expert) for k in g.policy.key_of if k >= 0]
        return tuple(held)

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        """`layer`'s predicted experts (ids [T, k]), from the FFN input of the block before it: uploaded ahead of
        its lookup right after that block's lookup (its own experts chosen first), without waiting for them.
        The lookup then waits only for the copies it reads (`Uploader.wait_ahead`)."""
        self._settled()  # (the lookups before this prediction, first)
        if self._ahead is not None:
            self._take_ahead()
        self._ahead = (layer, ids)
        if layer - 1 not in self.group_of:
            self._take_ahead()  # no lookup comes before it: now

    def _take_ahead(self, spare: tuple[int, np.ndarray] | None = None) -> None:
        layer, ids = self._ahead  # type: ignore[misc]  # (callers checked)
        self._ahead = None
        n_tokens, n_used = ids.shape
        flat = ids.cpu().reshape(-1).numpy()
        self._ahead_now(layer, flat, n_tokens, n_used, None, spare)

    def _ahead_now(self, layer: int, flat: np.ndarray, n_tokens: int, n_used: int, at: float | None,
                   spare: tuple[int, np.ndarray] | None = None) -> None:  # fmt: skip
        """A prediction of `layer`'s experts taken: written to the trace, kept for the recall, and with prefetch on,
        its misses uploaded (`at`: the clock's time it came, told afterwards; None: now), never into the slots of
        `spare` (the lookup just made, which its layer still reads)."""
        group = self.group_of.get(layer)
        policy = group.policy if group is not None else None
        if group is None or policy is None or bypasses(n_tokens, n_used, group.info.n_expert, policy.n_slots,
                                                       self.settings.max_batch):  # fmt: skip
            return
        self._predicted[layer] = flat
        if self._trace is not None:
            self._trace.write(-1 - layer, n_used, flat)  # a prediction's record
        if not self.settings.fetch_ahead:
            return
        with self._lock:
            uploads = policy.prefetch(layer, flat.tolist(), spare)
            count_prefetch(self.stats[layer].of(n_tokens), len(uploads), group.info.expert_bytes)
        if at is None:
            self.uploader.upload(group, self.host.layers[layer], uploads, ahead=True)
        else:
            self.uploader.told(len(uploads) * group.info.expert_bytes, at, ahead=True)

    def _run_uncached_on_device(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """A batch around the cache on a device: each selected expert from the host copy."""
        lx = self.host.layers[layer]
        uniq = ids.unique().tolist()
        return sum_parts(x, run_experts(lx, x, ids, weights, self.host.act, uniq, fetch=self._host_fetch(lx)))

    def _run_exact(
        self, layer: int, group: SlotGroup, policy: ClassLRU, lx: LayerExperts, x: torch.Tensor, ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Layers without kernels (or `--cpu-kernels exact`): each expert dequantized and multiplied, the
        CPU's part in the worker meanwhile."""
        plan = policy.last_plan()
        future: Future[list[Contribution]] | None = None
        if plan.cpu and self._worker is not None:
            xh, wh = x.cpu(), weights.cpu()  # the CPU part reads host copies
            future = self._worker.submit(run_experts, lx, xh, ids, wh, self.host.act, list(plan.cpu),
                                         fetch=self.host.fetcher(layer))  # fmt: skip
        self.uploader.upload(group, lx, plan.uploads)
        on_device = sorted([*plan.hits, *(e for e, _ in plan.uploads)])
        # On the CPU device a slot holds the host expert's very bytes: the dequant cache, when
        # there is one, serves both.
        host_fetch = self.host.fetcher(layer) if self.device.type == "cpu" else None
        fetch = host_fetch if host_fetch or self.in_place else self._slot_fetch(policy, group.banks, lx, layer)
        parts = run_experts(lx, x, ids, weights, self.host.act, on_device, fetch=fetch)
        if future is not None:
            parts += future.result()
        elif plan.cpu:
            parts += run_experts(lx, x.cpu(), ids, weights.cpu(), self.host.act, list(plan.cpu),
                                 fetch=self.host.fetcher(layer))  # fmt: skip
        return sum_parts(x, parts)

    def _run_fused(
        self, layer: int, group: SlotGroup, policy: ClassLRU, lx: LayerExperts, x: torch.Tensor, ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """CPU device, fused kernels: hits and uploads from the slots, the CPU share from the host copy.

        Both parts fill their own rows of one contribution buffer, summed once in expert order. The
        device is this CPU: the share runs inline, as handing it to another thread costs more than
        it could overlap. Slots in place (no banks) are the host copy: one call computes the layer.
        """
        xh, ih, wh = host_arrays(x, ids, weights)
        contrib = np.empty((ih.size, xh.shape[1]), np.float32)  # [T*k, E]
        plan = policy.last_plan()
        if self.in_place:
            if plan.n_uploads and self.uploader.link_gbps:
                self.uploader.upload(group, lx, plan.uploads)  # no bytes move: the emulated link's time
            # Every part reads the same host bytes with the same kernels: the layer in one call.
            self.host.run_host_part(layer, xh, ih, wh, None, contrib)
            return layer_output(contrib, ih)
        if plan.n_cpu:
            self.host.run_host_part(layer, xh, ih, wh, plan.cpu_array, contrib)
        if plan.n_uploads:
            self.uploader.upload(group, lx, plan.uploads)
        if plan.n_uploads or plan.n_hits:
            bits = self.host.bits_for(xh.shape[0], layer)
            run_fused(lx, group.host_banks, policy.slot_array(layer), self.host.act_code, xh, ih, wh,
                      plan.device_array if plan.n_cpu else None, contrib, bits)  # fmt: skip
        return layer_output(contrib, ih)

    def _run_triton(
        self, layer: int, group: SlotGroup, policy: ClassLRU, lx: LayerExperts, x: torch.Tensor, ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The device's experts in three launches (device_kernels), the CPU share from the host copy meanwhile."""
        plan = policy.last_plan()
        # The CPU share's inputs cross now, while the device is idle after the routing's sync.
        host_in = host_arrays(x, ids, weights) if plan.cpu else None
        self.uploader.upload(group, lx, plan.uploads)
        on_device = np.zeros(group.info.n_expert, dtype=bool)
        on_device[plan.device_array] = True
        ih = ids.cpu().numpy()  # the routing's one sync: the policy has read these ids already
        table, n_pairs = device_kernels.pair_table(ih, policy.slot_array(layer), on_device)
        table_d = torch.from_numpy(table).to(self.device, non_blocking=True)

        def host_part() -> torch.Tensor | None:
            if host_in is None:
                return None
            contrib = self._host_rows(layer, lx, host_in, list(plan.cpu))
            return torch.from_numpy(contrib).to(self.device, non_blocking=True)

        biases = (lx.gate.bias, lx.up.bias, lx.down.bias)
        banks = (group.banks[0], group.banks[1], group.banks[2])
        return device_kernels.run_layer(
            banks, (lx.gate.qtype, lx.up.qtype, lx.down.qtype), self._device_biases(layer, biases),
            self.host.act_code, x.float().contiguous(), weights.float().contiguous(), table_d, n_pairs, ih.shape[1],
            host_part,
        ).to(x.dtype)  # fmt: skip

    def _host_rows(
        self, layer: int, lx: LayerExperts, host_in: tuple[np.ndarray, ...], experts: list[int]
    ) -> np.ndarray:
        """The contributions of `experts` computed on the CPU, in their rows t*k + j of [T*k, E]."""
        xh, ih, wh = host_in
        contrib = np.empty((ih.size, xh.shape[1]), np.float32)  # only the rows of `experts` get set
        if self.host.fused[layer]:
            self.host.run_host_part(layer, xh, ih, wh, experts, contrib)
            return contrib
        ids = torch.from_numpy(ih)
        for e, tok, y in run_experts(lx, torch.from_numpy(xh), ids, torch.from_numpy(wh), self.host.act, experts,
                                     fetch=self.host.fetcher(layer)):  # fmt: skip
            j = (ids[tok] == e).int().argmax(-1)  # where e sits in each of its tokens' selections
            contrib[(tok * ih.shape[1] + j).numpy()] = y.numpy()
        return contrib

    def _device_biases(
        self, layer: int, biases: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The experts' biases [n_expert, rows] float32 on the device, moved there once per layer."""
        got = self._biases.get(layer)
        if got is None:
            moved = [None if b is None else b.float().contiguous().to(self.device) for b in biases]
            got = self._biases[layer] = (moved[0], moved[1], moved[2])
        return got

    def _host_fetch(self, lx: LayerExperts) -> Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Bypass on a device: upload an expert for this call only, without caching it."""
        dev = self.device

        def fetch(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (
                dequantize(lx.gate.raw[e].to(dev, non_blocking=True), lx.gate.qtype),
                dequantize(lx.up.raw[e].to(dev, non_blocking=True), lx.up.qtype),
                dequantize(lx.down.raw[e].to(dev, non_blocking=True), lx.down.qtype),
            )

        return fetch

    @staticmethod
    def _slot_fetch(
        policy: ClassLRU, banks: tuple[torch.Tensor, ...], lx: LayerExperts, layer: int
    ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Dequantized (gate, up, down) of an expert of `layer`, read from its slot."""
        gate_bank, up_bank, down_bank = banks

        def fetch(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            s = policy.slot_of(layer, e)
            return (
                dequantize(gate_bank[s], lx.gate.qtype),
                dequantize(up_bank[s], lx.up.qtype),
                dequantize(down_bank[s], lx.down.qtype),
            )

        return fetch

    # -- statistics --------------------------------------------------------------------------

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            layers = []
            for layer in sorted(self.host.layers):
                group = self.group_of[layer]
                st = self.stats[layer]
                small, large = st.small.frozen(), st.large.frozen()  # around the cache, prefetches
                cached: tuple[int, ...] = ()
                if group.policy is not None:
                    cached = tuple(e for e, s in enumerate(group.policy.slot_map[layer]) if s >= 0)
                    planned = group.policy.counted(layer, group.info.expert_bytes)
                    small, large = small + planned[0], large + planned[1]
                layers.append(
                    LayerSnapshot(layer, group.info.index, small, large, len(cached), cached,
                                  self._uses(layer, group.policy))
                )  # fmt: skip
            return StatsSnapshot(
                time.time(), self.tokens, tuple(g.info for g in self.groups), tuple(layers), self.settings.cpu_share,
                self.warm_uploads, self.warm_bytes, self.settings.policy,
            )  # fmt: skip

    def end_trace(self) -> Path | None:
        """Close the routing trace (lookups from now on go unrecorded); the file written, or None."""
        if self._trace is None:
            return None
        self._trace.close()
        path, self._trace = self._trace.path, None
        return path

    def close(self) -> None:
        self.save_warm_start()
        self.end_trace()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _one_thread() -> None:
    torch.set_num_threads(1)
    set_kernel_threads(1)
