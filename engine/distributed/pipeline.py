"""A decoder split by layers over the ranks of a torch.distributed group (gloo between CPU hosts).

Rank 0 embeds the tokens, runs its own layers, and hands the hidden state [T, E] to rank 1; each
rank runs its range of layers and hands the result on; the last rank hands it back to rank 0,
which applies the output norm and head and samples. Each rank keeps the KV cache (or linear
attention's state) of its own layers and its own expert cache for its MoE layers. To the
generation loop rank 0's `PipelineModel` is a model like any other (`generate.Model`).

What crosses per forward: a header [command, T, pos0] to every rank but the return, then the
hidden state as float32. Between forwards rank 0 may ask for every stage's cache counters
(`PipelineModel.snapshot`): each rank sends its snapshot to rank 0, which merges them. A forward
at position 0 starts a new sequence on every rank (fresh caches: the recurrent state of linear
attention starts from zero, as in one process).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..cache.stats import StatsSnapshot, merge_stages
from ..loader import LoadedModel
from ..nn.layers import KVCache
from .plan import Plan

logger = logging.getLogger(__name__)

STOP, FORWARD, SNAPSHOT = 0, 1, 2
HEADER = 3  # [command, T, pos0]


class PipelineModel:
    """Rank 0's side: the whole model to `generate`, its layers spread over the group's ranks."""

    def __init__(self, lm: LoadedModel, plan: Plan) -> None:
        self.lm = lm
        self.model = lm.model
        self.world = len(plan.hosts)
        self.end = plan.hosts[0].end
        self.n_embd = plan.n_embd

    def __call__(self, tokens: torch.Tensor, pos0: int, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        n = tokens.shape[0]
        x = self.model.run_blocks(self.model.embed_tokens(tokens), pos0, cache, 0, self.end)  # [T, E]
        if self.world > 1:
            try:
                dist.send(torch.tensor([FORWARD, n, pos0], dtype=torch.int64), dst=1)
                dist.send(x.float().contiguous(), dst=1)
                x = torch.empty(n, self.n_embd, dtype=torch.float32)
                dist.recv(x, src=self.world - 1)
            except RuntimeError as e:  # gloo: a peer closed its connection, or the group's timeout passed
                raise RankLost(f"a rank of the split stopped answering ({_first_line(e)})") from None
        cache.pos = pos0 + n
        return self.model.head(x[-1:] if last_only else x)  # [T or 1, V]

    def snapshot(self) -> StatsSnapshot | None:
        """Every stage's expert-cache counters as one snapshot, each MoE layer by its own index (None: no
        stage has a cache). Between forwards: the other ranks answer in rank order."""
        stages = [self.lm.cache.snapshot() if self.lm.cache is not None else None]
        if self.world > 1:
            try:
                dist.send(torch.tensor([SNAPSHOT, 0, 0], dtype=torch.int64), dst=1)
                for rank in range(1, self.world):
                    got: list[StatsSnapshot | None] = [None]
                    dist.recv_object_list(got, src=rank)
                    stages.append(got[0])
            except RuntimeError as e:
                raise RankLost(f"a rank of the split stopped answering ({_first_line(e)})") from None
        present = [s for s in stages if s is not None]
        return merge_stages(present) if present else None

    def close(self) -> None:
        """The other ranks stop serving (each passes the word on); a rank already gone is no error here."""
        if self.world > 1:
            try:
                dist.send(torch.tensor([STOP, 0, 0], dtype=torch.int64), dst=1)
            except RuntimeError as e:
                logger.warning("the split's ranks were not told to stop: %s", _first_line(e))


class RankLost(RuntimeError):
    """A rank of the split died or stopped answering within the group's timeout."""


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def serve(lm: LoadedModel, plan: Plan, rank: int) -> None:
    """A rank above 0: run its layers for every forward that comes, until STOP."""
    world = len(plan.hosts)
    first, end = plan.hosts[rank].first, plan.hosts[rank].end
    nxt = (rank + 1) % world
    cache = lm.new_cache()
    header = torch.empty(HEADER, dtype=torch.int64)
    while True:
        dist.recv(header, src=rank - 1)
        if nxt != 0:
            dist.send(header, dst=nxt)  # the next rank learns what comes before the data does
        command, n, pos0 = (int(v) for v in header.tolist())
        if command == STOP:
            return
        if command == SNAPSHOT:
            dist.send_object_list([lm.cache.snapshot() if lm.cache is not None else None], dst=0)
            continue
        if pos0 == 0:
            cache = lm.new_cache()
        x = torch.empty(n, plan.n_embd, dtype=torch.float32)
        dist.recv(x, src=rank - 1)
        x = lm.model.run_blocks(x, pos0, cache, first, end)
        cache.pos = pos0 + n
        dist.send(x.float().contiguous(), dst=nxt)
