"""Which layers go to which host, before any host loads anything.

A pipeline split: rank 0 holds the token embedding, the output norm and head (and the tokenizer,
sampling, the UI); each rank owns a contiguous range of the decoder's layers, maps only their
tensors from its own copy of the file, and keeps their KV cache (or linear-attention state). Per
token the hidden state [T, E] goes rank to rank and back to rank 0 for the head.

The split puts the layers where they fit best: contiguous ranges that make the fullest host as
empty as it can be, each host's need measured against its own memory. A host's need is the bytes
it maps, its layers' state at the context size, and a fixed headroom for the process itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import ModelConfig
from ..gguf.reader import GGUFFile, block_index
from ..nn.layers import layer_state_bytes

# What a rank's process needs besides its tensors and state: the interpreter, torch, numba's
# kernels, activations and the OS's own share of the host.
HEADROOM_BYTES = 2 * 2**30
HIDDEN_ITEMSIZE = 4  # the hidden state crosses as float32, as the layers compute it


@dataclass(frozen=True)
class HostShare:
    rank: int
    first: int  # its first layer
    end: int  # one past its last layer (first == end: no layers)
    weight_bytes: int  # the tensors it maps: its layers' (rank 0: also the embedding, output norm and head)
    state_bytes: int  # its layers' KV cache at the context size, and linear-attention state
    memory_bytes: int  # the host's memory

    @property
    def need_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes + HEADROOM_BYTES

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.memory_bytes

    @property
    def layers(self) -> range:
        return range(self.first, self.end)


@dataclass(frozen=True)
class Plan:
    hosts: tuple[HostShare, ...]
    n_embd: int
    n_ctx: int

    @property
    def wire_bytes_per_token(self) -> int:
        """The hidden state crossing each hop of one decode step: rank 0 -> 1 -> ... -> last -> rank 0."""
        hops = len(self.hosts) if len(self.hosts) > 1 else 0
        return hops * self.n_embd * HIDDEN_ITEMSIZE

    def misfit(self) -> HostShare | None:
        """The first host whose share does not fit its memory, or None."""
        return next((h for h in self.hosts if not h.fits), None)


def this_hosts_memory() -> int:
    """Bytes of memory of this machine (what a host is taken to have unless told)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def layer_weight_bytes(gguf: GGUFFile, cfg: ModelConfig) -> tuple[list[int], int]:
    """Bytes of each decoder layer's tensors, and of the rest (embedding, output norm, head) that rank 0
    maps. A file's trailing NextN blocks, which decoding skips, are nobody's."""
    per_layer = [0] * cfg.n_layers
    ends = 0
    for t in gguf.tensors.values():
        block = block_index(t.name)
        if block is None:
            ends += t.n_bytes
        elif block < cfg.n_layers:
            per_layer[block] += t.n_bytes
    return per_layer, ends


def plan_split(gguf: GGUFFile, cfg: ModelConfig, memory: Sequence[int], n_ctx: int) -> Plan:
    """The split of this file's layers over hosts of `memory` bytes each (rank 0 first), at `n_ctx`."""
    weights, ends = layer_weight_bytes(gguf, cfg)
    state = [layer_state_bytes(cfg, i, n_ctx) for i in range(cfg.n_layers)]
    return Plan(split_layers(weights, ends, state, memory), cfg.n_embd, n_ctx)


def split_layers(
    weights: Sequence[int], ends: int, state: Sequence[int], memory: Sequence[int]
) -> tuple[HostShare, ...]:
    """Contiguous layer ranges over the hosts (rank order), the fullest host as empty as possible.

    `weights` and `state`: each layer's bytes; `ends`: what rank 0 maps besides its layers; `memory`:
    each host's bytes. Every host gets at least one layer. Exact (dynamic programming over the split
    points): a few hosts and at most a few hundred layers."""
    if not memory or any(m <= 0 for m in memory):
        raise ValueError("each host needs a memory size above 0")
    n_hosts, n_layers = len(memory), len(weights)
    if n_hosts > n_layers:
        raise ValueError(f"{n_hosts} hosts for {n_layers} layers: at most one host per layer")
    prefix = [0]
    for w, st in zip(weights, state, strict=True):
        prefix.append(prefix[-1] + w + st)

    def load(host: int, first: int, end: int) -> float:  # the share of the host's memory it would need
        need = prefix[end] - prefix[first] + (ends if host == 0 else 0) + HEADROOM_BYTES
        return need / memory[host]

    # best[h][e]: the smallest possible fullest load of hosts 0..h holding layers 0..e-1; cut[h][e]
    # the first layer of host h there.
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_hosts)]
    cut = [[0] * (n_layers + 1) for _ in range(n_hosts)]
    for e in range(1, n_layers + 1):
        best[0][e] = load(0, 0, e)
    for h in range(1, n_hosts):
        for e in range(h + 1, n_layers + 1):
            for f in range(h, e):
                v = max(best[h - 1][f], load(h, f, e))
                if v < best[h][e]:
                    best[h][e], cut[h][e] = v, f
    bounds = [n_layers]
    for h in range(n_hosts - 1, 0, -1):
        bounds.append(cut[h][bounds[-1]])
    bounds.append(0)
    bounds.reverse()  # [0, cut_1, ..., n_layers]
    hosts = []
    for h in range(n_hosts):
        first, end = bounds[h], bounds[h + 1]
        own = sum(weights[first:end]) + (ends if h == 0 else 0)
        hosts.append(HostShare(h, first, end, own, sum(state[first:end]), memory[h]))
    return tuple(hosts)
