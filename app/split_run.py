"""`moechat run` as one rank of a model split over hosts, when torchrun started it.

    torchrun --nnodes 2 --node-rank R --master-addr HOST0 --master-port 29500 --nproc-per-node 1 \\
        -m moechat run MODEL.gguf -p "Hello" [every flag of moechat run]

Every rank loads its own layers (engine/distributed); rank 0 streams the reply and prints the
speeds and the merged cache summary of every stage, as one process would; the other ranks print
nothing and exit 0 when rank 0 is done. Any rank's failure is one line naming the rank.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from moechat.app.settings import Settings, cache_settings

Reply = Callable[..., int]  # run_cmd.reply: (args, settings, loaded model, model, snapshot) -> exit status


def run_as_rank(args: argparse.Namespace, settings: Settings, reply: Reply) -> int:
    """This process's rank; on rank 0 `reply(args, settings, lm, pipeline, snapshot)` (run_cmd's) answers
    the prompt. The exit status."""
    import torch.distributed as dist
    from moechat.app.demo_model import resolve_model
    from moechat.engine.distributed.run import join, launched, run_split
    from moechat.engine.loader import set_threads

    ranks = launched()
    if ranks is None:
        raise ValueError("not started as a rank of a group (torchrun sets RANK and WORLD_SIZE)")
    rank, world = ranks
    set_threads(settings.threads)
    path = resolve_model(args.model)
    join(rank, world)
    try:
        code = run_split(path, lambda pm, lm: reply(args, settings, lm, pm, pm.snapshot), n_ctx=settings.ctx_size,
                         cache=cache_settings(settings), chat_template=settings.chat_template or None,
                         cpu_kernels=settings.cpu_kernels, cpu_dequant_mib=settings.cpu_dequant_mib)  # fmt: skip
    except (ValueError, OSError, RuntimeError) as e:  # RankLost is a RuntimeError
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"moechat: error: rank {rank}: {line}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0 if code is None else code
