"""A model split over hosts: decode speed with 1, 2 and 3 local ranks, the bytes on the wire, and on paper
DeepSeek-V3 Q2_K over two 128 GB hosts on 10 GbE.

    python bench/distributed.py [--tokens 48] [--rounds 2] [--skip-local]

Local: a generated MoE model (8 layers, 32 experts of 512x1024 Q8_0, top-4), greedy, each rank
one thread on this machine's cores (gloo over 127.0.0.1), rounds alternating 1, 2, 3 ranks. On one
machine the ranks share its cores and memory bus, so the split shows its own cost (the hops, the
hand-over) and no gain: the gain is memory, on hosts that each hold a part.

On paper: each host reads its layers' bytes for a token (the used experts and the dense weights)
at its memory's read speed, one host after another (a pipeline runs one token through all of
them); each hop adds the link's latency and the hidden state's bytes over its bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_on_paper import MODELS, end_tensors, layer_tensors, nbytes, typed
from moechat.engine.distributed.plan import HEADROOM_BYTES, HIDDEN_ITEMSIZE, split_layers


def local(tokens: int, rounds: int) -> None:
    import multiprocessing as mp

    from moechat.engine.distributed.plan import plan_split
    from moechat.engine.models.opening import open_model
    from testkit.distributed import free_port
    from testkit.ggufgen import tiny_moe

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_moe(Path(tmp) / "m.gguf", n_layers=8, n_embd=512, n_expert=32, n_expert_used=4, n_ff_exp=1024)
        print(f"model: {path.stat().st_size / 1e6:.0f} MB, {tokens} tokens per run, load {os.getloadavg()[0]:.2f}")
        tps: dict[int, list[float]] = {1: [], 2: [], 3: []}
        resident: dict[int, list[int]] = {}
        for _ in range(rounds):
            for world in (1, 2, 3):
                ctx = mp.get_context("spawn")
                out = ctx.Queue()
                address = f"127.0.0.1:{free_port()}"
                procs = [ctx.Process(target=_timed_rank, args=(r, world, address, str(path), tokens, out))
                         for r in range(world)]  # fmt: skip
                for p in procs:
                    p.start()
                results = dict(out.get(timeout=600) for _ in range(world))
                for p in procs:
                    p.join(60)
                tps[world].append(results[0][0])
                resident[world] = [results[r][1] for r in range(world)]
        base = statistics.median(tps[1])
        print(f"\n{'ranks':>5} {'decode t/s (median)':>20} {'vs 1 rank':>10} {'wire bytes/token':>17}  "
              "the file's MB resident in each rank / its share")  # fmt: skip
        gguf, cfg = open_model(path)
        with gguf:
            for world, values in tps.items():
                wire = (world if world > 1 else 0) * 512 * HIDDEN_ITEMSIZE
                plan = plan_split(gguf, cfg, [64 * 2**30] * world, 512)
                held = ", ".join(f"{r / 1e6:.1f} / {h.weight_bytes / 1e6:.1f}"
                                 for r, h in zip(resident[world], plan.hosts, strict=True))  # fmt: skip
                print(f"{world:>5} {statistics.median(values):>20.1f} {statistics.median(values) / base:>9.2f}x "
                      f"{wire:>17,}  {held}")  # fmt: skip
        print(f"load average after: {os.getloadavg()[0]:.2f}")


def _timed_rank(rank: int, world: int, address: str, path: str, tokens: int, out: object) -> None:
    import torch.distributed as dist
    from moechat.engine.distributed.pipeline import PipelineModel
    from moechat.engine.distributed.run import join, run_split
    from moechat.engine.events import GREEDY, TokenEvent
    from moechat.engine.generate import generate
    from moechat.engine.loader import LoadedModel, set_threads
    from testkit.distributed import resident_bytes

    set_threads(1)
    join(rank, world, address)

    def job(pm: PipelineModel, lm: LoadedModel) -> tuple[float, int]:
        ids = lm.tokenizer.encode("The lighthouse stood at the end of a long spit of rock")
        events = generate(pm, lm.tokenizer, ids, lm.new_cache(), max_tokens=tokens, params=GREEDY, ignore_eos=True)
        stamps = [time.perf_counter() for e in events if isinstance(e, TokenEvent) and e.token >= 0]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0]), resident_bytes(path)

    def served(lm: LoadedModel) -> tuple[float, int]:
        return 0.0, resident_bytes(path)

    try:
        result = run_split(Path(path), job, n_ctx=512, memory=64 * 2**30, served=served)
        out.put((rank, result))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def on_paper(ram_gb: float, read_gbps: float, link_gbps: float, latency_us: float, ctx: int) -> None:
    g = next(m for m in MODELS if m.name == "DeepSeek-V3")
    weights, active = [], []
    for i in range(g.n_layers):
        w = a = 0
        for name, shape, t in (typed(g, i, *x) for x in layer_tensors(g, i)):
            n = nbytes(shape, t)
            w += n
            a += n * g.used // g.experts if "_exps." in name else n
        weights.append(w)
        active.append(a)
    ends_list = [(name, nbytes(shape, t)) for name, shape, t in (typed(g, 0, *x) for x in end_tensors(g))]
    ends = sum(n for _, n in ends_list)
    ends_read = sum(n if name != "token_embd.weight" else n // g.vocab for name, n in ends_list)
    state = [ctx * (g.mla[1] + g.mla[3]) * 4] * g.n_layers  # the latent cache, float32
    hosts = split_layers(weights, ends, state, [int(ram_gb * 1e9)] * 2)
    print(f"\nOn paper: {g.name} {g.mix}, {g.n_layers} layers, {sum(weights) / 1e9:.0f} GB of layers + "
          f"{ends / 1e9:.1f} GB ends, over 2 hosts of {ram_gb:g} GB (headroom {HEADROOM_BYTES / 2**30:g} GiB each), "
          f"context {ctx}")  # fmt: skip
    step = 0.0
    for h in hosts:
        read = sum(active[h.first : h.end]) + (ends_read if h.rank == 0 else 0)
        secs = read / (read_gbps * 1e9)
        step += secs
        print(f"  host {h.rank}: layers {h.first}-{h.end - 1}, maps {h.weight_bytes / 1e9:.0f} GB, needs "
              f"{h.need_bytes / 1e9:.0f} GB of {h.memory_bytes / 1e9:.0f} ({'fits' if h.fits else 'does NOT fit'}); "
              f"reads {read / 1e9:.2f} GB per token, {1000 * secs:.1f} ms at {read_gbps:g} GB/s")  # fmt: skip
    hop = latency_us * 1e-6 + g.n_embd * HIDDEN_ITEMSIZE / (link_gbps / 8 * 1e9)
    step += 2 * hop
    print(f"  wire: {2 * g.n_embd * HIDDEN_ITEMSIZE:,} bytes per token over 2 hops, {1e6 * hop:.0f} us each on "
          f"{link_gbps:g} Gb/s with {latency_us:g} us latency")  # fmt: skip
    print(f"  expected decode: {1 / step:.1f} tokens/s ({1000 * step:.0f} ms per token; the hops are "
          f"{100 * 2 * hop / step:.1f}% of it)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--ram-gb", type=float, default=128)
    ap.add_argument("--read-gbps", type=float, default=40.0, help="each host's memory read speed, GB/s")
    ap.add_argument("--link-gbits", type=float, default=10.0)
    ap.add_argument("--latency-us", type=float, default=100.0, help="one hop's latency (gloo over TCP)")
    ap.add_argument("--ctx", type=int, default=8192)
    args = ap.parse_args()
    if not args.skip_local:
        local(args.tokens, args.rounds)
    on_paper(args.ram_gb, args.read_gbps, args.link_gbits, args.latency_us, args.ctx)


if __name__ == "__main__":
    main()
