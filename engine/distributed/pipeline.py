"""A decoder split by layers over the ranks of a torch.distributed group (gloo between CPU hosts).

Rank 0 embeds the tokens, runs its own layers, and hands the hidden state [T, E] to rank 1; each
rank runs its range of layers and hands the result on; the last rank hands it back to rank 0,
which applies the output norm and head and samples. Each rank keeps the KV cache (or linear
attention's state) of its own layers and its own expert cache for its MoE layers. To the
generation loop rank 0's `PipelineModel` is a model like any other (`generate.Model`).

What crosses per forward: a header [command, T, pos0, wait ms] to every rank but the return, then
the hidden state as float32. Between forwards rank 0 may ask every stage for its cache counters
(`snapshot`), set every stage's cache anew (`set_cache`) or collect the stages' routing traces
(`join_traces`). A forward at position 0 starts a new sequence on every rank (fresh caches: the
recurrent state of linear attention starts from zero, as in one process).

How long a rank waits: for the next command, as long as rank 0 idles (a chat waits for its user);
for a forward's hidden state, the group's timeout plus ten times what rank 0's own layers took for
that forward, times the ranks, so a long prompt on a slow host is not taken for a lost rank. A rank
whose process ends is noticed at once: its peers' connections close.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..cache.settings import CacheSettings
from ..cache.stats import StatsSnapshot, merge_stages
from ..cache.trace import join_stages
from ..loader import LoadedModel
from ..nn.layers import KVCache
from .plan import Plan

logger = logging.getLogger(__name__)

STOP, FORWARD, SNAPSHOT, SET_CACHE, TRACE = 0, 1, 2, 3, 4
HEADER = 4  # [command, T, pos0, how long to wait for the hidden state, ms]
IDLE_S = 14 * 86400.0  # a serving rank waits this long for rank 0's next command
SLACK = 10.0  # a forward's wait: this many times rank 0's own time for it, per rank, beyond the timeout


def _recv(tensor: torch.Tensor, src: int, seconds: float) -> None:
    work = dist.irecv(tensor, src=src)
    if work is not None:  # (None only on a rank outside the group)
        work.wait(timeout=timedelta(seconds=seconds))


def _lost(e: RuntimeError) -> RankLost:
    return RankLost(f"a rank of the split stopped answering ({_first_line(e)})")


class PipelineModel:
    """Rank 0's side: the whole model to `generate`, its layers spread over the group's ranks."""

    def __init__(self, lm: LoadedModel, plan: Plan, timeout_s: float = 60.0) -> None:
        self.lm = lm
        self.model = lm.model
        self.world = len(plan.hosts)
        self.end = plan.hosts[0].end
        self.n_embd = plan.n_embd
        self.timeout_s = timeout_s
        self.part = _trace_part(lm)

    def _command(self, command: int, n: int = 0, pos0: int = 0, wait_s: float = 0.0) -> None:
        dist.send(torch.tensor([command, n, pos0, round(wait_s * 1000)], dtype=torch.int64), dst=1)

    def __call__(self, tokens: torch.Tensor, pos0: int, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        n = tokens.shape[0]
        t0 = time.perf_counter()
        x = self.model.run_blocks(self.model.embed_tokens(tokens), pos0, cache, 0, self.end)  # [T, E]
        if self.world > 1:
            wait_s = self.timeout_s + SLACK * (time.perf_counter() - t0) * self.world
            try:
                self._command(FORWARD, n, pos0, wait_s)
                dist.send(x.float().contiguous(), dst=1)
                x = torch.empty(n, self.n_embd, dtype=torch.float32)
                _recv(x, self.world - 1, wait_s * self.world)
            except RuntimeError as e:  # gloo: a peer closed its connection, or the wait passed
                raise _lost(e) from None
        cache.pos = pos0 + n
        return self.model.head(x[-1:] if last_only else x)  # [T or 1, V]

    def _gather(self, command: int, mine: object) -> list[object]:
        """Every rank's answer to `command` (rank 0's is `mine`), in rank order."""
        answers: list[object] = [mine]
        if self.world > 1:
            try:
                self._command(command)
                answers += self._answers()
            except RuntimeError as e:
                raise _lost(e) from None
        return answers

    def snapshot(self) -> StatsSnapshot | None:
        """Every stage's expert-cache counters as one snapshot, each MoE layer by its own index (None: no
        stage has a cache). Between forwards: the other ranks answer in rank order."""
        stages = self._gather(SNAPSHOT, _stage_snapshot(self.lm))
        present = [s for s in stages if isinstance(s, StatsSnapshot)]
        return merge_stages(present) if present else None

    def set_cache(self, settings: CacheSettings | None) -> None:
        """Every stage's expert cache anew (each its own layers, each `settings.mib` MiB). ValueError: the
        first stage that could not (the others have theirs)."""
        errors: list[object] = [_set_cache(self.lm, settings)]
        if self.world > 1:
            try:
                self._command(SET_CACHE)
                for rank in range(1, self.world):
                    dist.send_object_list([settings], dst=rank)
                errors += self._answers()
            except RuntimeError as e:
                raise _lost(e) from None
        for rank, error in enumerate(errors):
            if error is not None:
                raise ValueError(f"rank {rank}: {error}")

    def _answers(self) -> list[object]:
        """One object from each rank above 0, in rank order."""
        out = []
        for rank in range(1, self.world):
            got: list[object] = [None]
            dist.recv_object_list(got, src=rank)
            out.append(got[0])
        return out

    def join_traces(self, target: Path) -> None:
        """End every stage's routing trace and write them at `target` joined, as one process's trace;
        every stage's own part is removed. Nothing when no stage recorded one."""
        parts = [p for p in self._gather(TRACE, _trace_bytes(self.lm, self.part)) if isinstance(p, bytes)]
        if parts:
            target.write_bytes(join_stages(parts))

    def close(self) -> None:
        """The other ranks stop serving (each passes the word on); a rank already gone is no error here."""
        if self.world > 1:
            try:
                self._command(STOP)
            except RuntimeError as e:
                logger.warning("the split's ranks were not told to stop: %s", _first_line(e))


class RankLost(RuntimeError):
    """A rank of the split died or stopped answering within the group's timeout."""


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def stage_file(path: Path, rank: int) -> Path:
    """A stage's own file where one process has `path`: its part of the routing trace (until rank 0
    joins the parts at `path`), its warm start (ranks on one host would overwrite each other's)."""
    return path.with_name(f"{path.stem}.stage{rank}{path.suffix}")


def _trace_part(lm: LoadedModel) -> Path | None:
    """Where this stage records its routing (its cache's trace, from the start: a cache set anew later
    records none, and the part ends there, as one process's trace does)."""
    return lm.cache.settings.trace if lm.cache is not None else None


def _trace_bytes(lm: LoadedModel, part: Path | None) -> bytes | None:
    """This stage's part of the routing trace, ended; its file removed (rank 0 writes the joined one)."""
    if lm.cache is not None:
        lm.cache.end_trace()
    if part is None or not part.exists():
        return None
    data = part.read_bytes()
    part.unlink()
    return data


def _stage_snapshot(lm: LoadedModel) -> StatsSnapshot | None:
    """This stage's cache counters (None: it has no cache)."""
    return lm.cache.snapshot() if lm.cache is not None else None


def _set_cache(lm: LoadedModel, settings: CacheSettings | None) -> str | None:
    try:
        lm.set_cache(settings)
    except ValueError as e:
        return _first_line(e)
    return None


def serve(lm: LoadedModel, plan: Plan, rank: int) -> None:
    """A rank above 0: run its layers for every forward that comes, until STOP."""
    world = len(plan.hosts)
    first, end = plan.hosts[rank].first, plan.hosts[rank].end
    nxt = (rank + 1) % world
    cache = lm.new_cache()
    part = _trace_part(lm)
    header = torch.empty(HEADER, dtype=torch.int64)
    while True:
        _recv(header, rank - 1, IDLE_S)
        if nxt != 0:
            dist.send(header, dst=nxt)  # the next rank learns what comes before the data does
        command, n, pos0, wait_ms = (int(v) for v in header.tolist())
        if command == STOP:
            return
        if command == SNAPSHOT:
            dist.send_object_list([_stage_snapshot(lm)], dst=0)
        elif command == TRACE:
            dist.send_object_list([_trace_bytes(lm, part)], dst=0)
        elif command == SET_CACHE:
            got: list[CacheSettings | None] = [None]
            dist.recv_object_list(got, src=0)
            dist.send_object_list([_set_cache(lm, got[0])], dst=0)
        else:
            if pos0 == 0:
                cache = lm.new_cache()
            x = torch.empty(n, plan.n_embd, dtype=torch.float32)
            _recv(x, rank - 1, wait_ms * rank / 1000)
            x = lm.model.run_blocks(x, pos0, cache, first, end)
            cache.pos = pos0 + n
            dist.send(x.float().contiguous(), dst=nxt)
