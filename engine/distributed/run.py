"""Running a model split over the ranks of a torch.distributed group: joining it, the same-file check,
the plan every rank agrees on, and each rank's part.

    torchrun --nnodes 2 --node-rank R --master-addr HOST0 --master-port 29500 --nproc-per-node 1 \\
        -m moechat.engine.distributed.run MODEL.gguf -p "Hello" -n 64

Rank 0 prints the prompt and its greedy continuation; the other ranks serve their layers until rank 0 is done.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from ..cache.settings import CacheSettings
from ..events import GREEDY, TokenEvent
from ..generate import generate
from ..gguf.identity import file_identity
from ..loader import LoadedModel, load_model
from ..models.opening import open_model
from .pipeline import PipelineModel, serve, stage_file
from .plan import Plan, plan_split, this_hosts_memory

T = TypeVar("T")
TIMEOUT_S = 60.0  # a rank that does not answer within this ends the run with an error


def join(rank: int, world: int, address: str = "", timeout_s: float = TIMEOUT_S) -> None:
    """Join the group (gloo): `address` "host:port" of rank 0, or "" to read torchrun's environment."""
    method = f"tcp://{address}" if address else "env://"
    dist.init_process_group("gloo", init_method=method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip


def agree(path: Path, memory: int) -> list[int]:
    """Every rank runs the same file (compared by identity before any work) and knows every host's
    memory, so that all compute the same plan. ValueError naming the first rank whose file differs."""
    mine = (file_identity(path), memory)
    everyone: list[tuple[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    sizes = []
    for rank, other in enumerate(everyone):
        if other is None or everyone[0] is None or other[0] != everyone[0][0]:
            raise ValueError(f"rank {rank} runs another model file than rank 0: every host needs the very same "
                             "file")  # fmt: skip
        sizes.append(other[1])
    return sizes


def run_split(path: Path, on_rank0: Callable[[PipelineModel, LoadedModel], T], *, n_ctx: int = 4096,
              cache: CacheSettings | None = None, memory: int | None = None,
              served: Callable[[LoadedModel], T] | None = None, timeout_s: float = TIMEOUT_S,
              **load: Any) -> T | None:  # fmt: skip
    """This rank's part of a split run (after `join`): rank 0 calls `on_rank0` with the whole model
    behind a PipelineModel and returns what it returns; the other ranks serve until rank 0 is done,
    then return `served(their model)` (None without it). `load`: more of load_model's options.

    Each stage records its routing (`cache.trace`) beside the target and rank 0 joins the parts there
    when `on_rank0` returns; each rank keeps its warm start in a file of its own (`stage_file`)."""
    rank = dist.get_rank()
    trace = cache.trace if cache is not None else None
    if cache is not None:
        cache = replace(cache, trace=trace and stage_file(trace, rank),
                        warm_start=cache.warm_start and stage_file(cache.warm_start, rank))  # fmt: skip
    sizes = agree(path, memory or this_hosts_memory())
    gguf, cfg = open_model(path)  # the header only: the plan comes before any page is read
    with gguf:
        plan: Plan = plan_split(gguf, cfg, sizes, n_ctx)
        bad = plan.misfit()
        if bad is not None:
            raise ValueError(f"host {bad.rank} needs {bad.need_bytes / 2**30:.1f} GiB for layers "
                             f"{bad.first}-{bad.end - 1} and has {bad.memory_bytes / 2**30:.1f} GiB")  # fmt: skip
    lm = load_model(path, n_ctx=n_ctx, cache=cache, own_layers=plan.hosts[rank].layers, **load)
    try:
        if rank != 0:
            serve(lm, plan, rank)
            return served(lm) if served is not None else None
        pm = PipelineModel(lm, plan, timeout_s)
        try:
            result = on_rank0(pm, lm)
            if trace is not None:
                pm.join_traces(trace)
            return result
        finally:
            pm.close()
    finally:
        lm.close()


def greedy_tokens(prompt: str, n: int) -> Callable[[PipelineModel, LoadedModel], list[int]]:
    """Rank 0's job for a plain run: the greedy continuation of `prompt`, `n` tokens."""

    def job(pm: PipelineModel, lm: LoadedModel) -> list[int]:
        ids = lm.tokenizer.encode(prompt)
        events = generate(pm, lm.tokenizer, ids, lm.new_cache(), max_tokens=n, params=GREEDY, ignore_eos=True)
        return [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]

    return job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moechat.engine.distributed.run", description=__doc__)
    ap.add_argument("model")
    ap.add_argument("-p", "--prompt", default="Hello")
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    args = ap.parse_args(argv)
    join(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    tokens_of = greedy_tokens(args.prompt, args.n_predict)

    def reply(pm: PipelineModel, lm: LoadedModel) -> str:
        return lm.tokenizer.decode(tokens_of(pm, lm))

    try:
        text = run_split(Path(args.model), reply, n_ctx=args.ctx_size)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"moechat: error: rank {dist.get_rank()}: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    if text is not None:
        print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
