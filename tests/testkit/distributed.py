"""Running a split model over processes of this machine, for the tests: gloo on 127.0.0.1, one
process per rank (spawned: a fresh interpreter each, as torchrun starts them)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from pathlib import Path
from typing import Any

from moechat.engine.cache.settings import CacheSettings

PROMPT = "The river rose in spring and the"
N_TOKENS = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resident_bytes(path: str | Path) -> int:
    """Bytes of `path`'s pages resident in this process's maps (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping's header line
                inside = parts[-1] == str(path)
            elif inside and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    return total


def _rank(rank: int, world: int, address: str, path: str, cache: CacheSettings | None, out: Any,
          timeout_s: float = 120.0, pause_s: float = 0.0) -> None:  # fmt: skip
    """Rank 0 puts (its greedy tokens, the file's bytes resident in it, {MoE layer: (counters, group)} of
    the merged cache snapshot or None, the number of groups); the others (None, the file's bytes resident)."""
    import torch.distributed as dist
    from moechat.engine.distributed.run import greedy_tokens, join, run_split
    from moechat.engine.loader import set_threads

    set_threads(1)  # the ranks share this machine's cores
    join(rank, world, address, timeout_s=timeout_s)
    tokens_of = greedy_tokens(PROMPT, N_TOKENS)

    def job(pm: Any, lm: Any) -> tuple[Any, ...]:
        tokens = tokens_of(pm, lm)
        if pause_s:  # rank 0 idles (a chat's user thinking), then asks again
            time.sleep(pause_s)
            tokens = [tokens, tokens_of(pm, lm)]
        snap = pm.snapshot()  # every stage's cache counters, on rank 0
        layers = {x.layer: (x.total, x.group) for x in snap.layers} if snap is not None else None
        return tokens, resident_bytes(path), layers, len(snap.groups) if snap is not None else 0

    try:
        result = run_split(Path(path), job, n_ctx=256, cache=cache, memory=64 * 2**30, timeout_s=timeout_s,
                           served=lambda lm: (None, resident_bytes(path)))  # fmt: skip
        out.put((rank, result))
    except Exception as e:  # the parent shows it
        out.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def run_ranks(path: Path | list[Path], world: int, cache: CacheSettings | None, timeout_s: float = 120.0,
              pause_s: float = 0.0) -> dict[int, Any]:  # fmt: skip
    """Each rank's result: (rank 0's greedy tokens or None, the file's bytes resident in the rank), or the
    error a rank met.
    `path`: one file for every rank, or one per rank. `timeout_s`: the group's; `pause_s`: rank 0 idles
    this long after its reply and replies again (its tokens: both replies')."""
    paths = path if isinstance(path, list) else [path] * world
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, world, address, str(paths[r]), cache, out, timeout_s, pause_s))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join(60)
    return results


def _rank_until_lost(rank: int, world: int, address: str, path: str, out: Any) -> None:
    """Rank 0 writes reply after reply (saying "writing" after the first) until the split fails."""
    import time

    from moechat.engine.distributed.run import join, run_split
    from moechat.engine.events import GREEDY, TokenEvent
    from moechat.engine.generate import generate
    from moechat.engine.loader import set_threads

    set_threads(1)
    join(rank, world, address, timeout_s=LOST_TIMEOUT_S)

    def forever(pm: Any, lm: Any) -> None:
        ids = lm.tokenizer.encode(PROMPT)
        while True:
            for e in generate(pm, lm.tokenizer, ids, lm.new_cache(), max_tokens=64, params=GREEDY, ignore_eos=True):
                if isinstance(e, TokenEvent) and e.index == 0:
                    out.put((rank, "writing"))

    try:
        run_split(Path(path), forever, n_ctx=256, memory=64 * 2**30)
    except Exception as e:
        out.put((rank, f"{type(e).__name__}: {e}", time.monotonic()))


LOST_TIMEOUT_S = 20.0


def start_until_lost(path: Path, world: int) -> tuple[list[Any], Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_until_lost, args=(r, world, address, str(path), out)) for r in range(world)]
    for p in procs:
        p.start()
    return procs, out
