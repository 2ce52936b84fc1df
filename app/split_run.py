"""`moechat run` and `moechat chat` as one rank of a model split over hosts, when torchrun started them.

    torchrun --nnodes 2 --node-rank R --master-addr HOST0 --master-port 29500 --nproc-per-node 1 \\
        -m moechat run MODEL.gguf -p "Hello" [every flag of moechat run]
    torchrun ... -m moechat chat MODEL.gguf [every flag of moechat chat]

Every rank loads its own layers (engine/distributed). `run`: rank 0 streams the reply and prints the
speeds and the merged cache summary of every stage, as one process would. `chat`: rank 0 is the app,
whose engine process joins the group as rank 0 (engine_process.py). The other ranks print nothing and
exit 0 when rank 0 is done. Any rank's failure is one line naming the rank.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moechat.app.settings import Settings, cache_settings

if TYPE_CHECKING:
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.distributed.pipeline import PipelineModel
    from moechat.engine.loader import LoadedModel


def run_split_rank(path: Path, settings: Settings, cache: CacheSettings,
                   on_rank0: Callable[[PipelineModel, LoadedModel], Any] | None,
                   progress: Callable[[str], None] | None = None) -> Any:  # fmt: skip
    """Join the group torchrun started and run this rank's part with `settings`' engine options: rank 0
    calls `on_rank0` (None: this process is not meant to be rank 0) and returns what it returns."""
    import torch.distributed as dist
    from moechat.engine.distributed import launched
    from moechat.engine.distributed.run import join, run_split
    from moechat.engine.loader import set_threads

    ranks = launched()
    if ranks is None:
        raise ValueError("not started as a rank of a group (torchrun sets RANK and WORLD_SIZE)")
    rank, world = ranks
    if rank == 0 and on_rank0 is None:
        raise ValueError("rank 0 of a split runs the chat or the prompt, not this")
    set_threads(settings.threads)
    join(rank, world)
    try:
        return run_split(path, on_rank0 or _unused, n_ctx=settings.ctx_size, cache=cache,
                         chat_template=settings.chat_template or None, cpu_kernels=settings.cpu_kernels,
                         cpu_dequant_mib=settings.cpu_dequant_mib, progress=progress)  # fmt: skip
    finally:
        dist.destroy_process_group()


def _unused(pm: PipelineModel, lm: LoadedModel) -> None:
    raise AssertionError("only rank 0 runs the job")


Job = Callable[["PipelineModel", "LoadedModel", "str | None", "CacheSettings"], int]


def run_as_rank(model: str | None, settings: Settings, job: Job | None, warm_dir: Path | None = None) -> int:
    """This process's rank of a split run of `model` (None: the demo). Rank 0 runs `job(pipeline, its own
    stage, the file's identity, the cache settings)` (`moechat run`'s reply, the line-mode chat); None:
    this rank only serves (`moechat chat` above rank 0: rank 0's app has its own engine process).
    `warm_dir`: where the warm start's files live (None: no warm start). The exit status."""
    from moechat.app.demo_model import resolve_model
    from moechat.app.tuned import identity_of
    from moechat.engine.distributed import launched

    ranks = launched()
    rank = ranks[0] if ranks is not None else 0
    try:
        path = resolve_model(model)
        identity = identity_of(path)
        cache = cache_settings(settings, warm_dir / f"{identity}.json" if warm_dir and identity else None)
        on_rank0 = None if job is None else functools.partial(_with, job, identity, cache)
        code = run_split_rank(path, settings, cache, on_rank0)
    except (ValueError, OSError, RuntimeError) as e:  # RankLost is a RuntimeError
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"moechat: error: rank {rank}: {line}", file=sys.stderr)
        return 2
    return 0 if code is None else int(code)


def _with(job: Job, identity: str | None, cache: CacheSettings, pm: PipelineModel, lm: LoadedModel) -> int:
    return job(pm, lm, identity, cache)
