"""Does the tuner's method work? Emulated links of known speed, a sweep each, and held-out runs.

    python bench/tune_accuracy.py [--links 4] [--tokens 256] [--repeats 3]

For each emulated link speed X (CPU device, uploads cost bytes / X): run the 6-arm calibration
sweep on a generated MoE model (4 layers, 32 experts of 512x1024 Q8_0, top-4; 214 MB), fit the
time model as `moechat tune` does (the CPU device: CPU misses cost what hits do), and compare the
fitted upload speed with X and the leave-one-out error with the issue's 15%. Then measure 3 held-out (size, share)
points (run together, as the sweep runs its arms on the CPU device) and compare their t/s with
the prediction, two ways: the tuner's own (replaying the
calibration traces), and from the held-out run's own traffic (the time model alone).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.tuner.events import SweepDone
from moechat.tuner.recommend import observations, predict_rows
from moechat.tuner.simulator import load_routing
from moechat.tuner.sweep import SweepSettings, calibrate, run_arms_interleaved
from moechat.tuner.time_model import fit
from testkit.ggufgen import tiny_moe

HELD_OUT = ((0.20, 0.8), (0.40, 0.5), (0.15, 0.9))  # fraction of the experts, share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", type=float, nargs="+", default=[4.0], help="GB/s")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per arm (moechat tune's default)")
    ap.add_argument("--repeats", type=int, default=3, help="sweeps per link, each measured afresh")
    args = ap.parse_args()
    from moechat.engine.cache.settings import CacheSettings
    from moechat.engine.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_moe(Path(tmp) / "bench.gguf", n_layers=4, n_embd=512, n_expert=32, n_expert_used=4,
                        n_ff_exp=1024)  # fmt: skip
        lm = load_model(path, n_ctx=512, cache=CacheSettings(mib=0))
        expert_mib = sum(lx.bytes_per_expert * 32 for lx in lm.model.host_experts.layers.values()) / 2**20
        print(f"model: {expert_mib:.0f} MiB of experts; {args.tokens} tokens per arm")
        rows = []
        print(f"load average {os.getloadavg()[0]:.2f}")
        for link, rep in itertools.product(args.links, range(args.repeats)):
            settings = SweepSettings(model=path, device="cpu", n_ctx=512, emulate_link_gbps=link, tokens=args.tokens,
                                     seed=1 + rep)  # fmt: skip
            done = [e for e in calibrate(settings, cache_dir=Path(tmp) / "c", loaded=lm)][-1]
            assert isinstance(done, SweepDone)
            model = fit(observations(done.arms), cpu_is_device=True)
            want = link * 1e9 / 2**30
            print(f"link {link} GB/s = {want:.3f} GiB/s: fitted uploads {model.upload_gibps:.3f} GiB/s "
                  f"({100 * (model.upload_gibps / want - 1):+.1f}%), "
                  f"{'CPU misses free' if model.cpu_free else f'CPU {model.cpu_gibps:.3f} GiB/s'}, "
                  f"fit within {100 * model.max_error:.1f}%, leave-one-out {100 * model.spread:.1f}%"
                  f"{'' if model.physical else ' (not physical)'}")  # fmt: skip
            if rep:
                continue
            routing = None
            for a in done.arms:
                r = load_routing(done.run_dir / a.trace)
                routing = r if routing is None else routing.concat(r)
            assert routing is not None
            prompt = lm.tokenizer.encode(settings.prompt)
            # Measured as the sweep measures on the CPU device: together, a token of each in turn.
            held = [(10 + i, round(frac * expert_mib, 1), share) for i, (frac, share) in enumerate(HELD_OUT)]
            gen = run_arms_interleaved(lm, settings, done.run_dir, held, 0, prompt, None)
            try:
                while True:
                    next(gen)
            except StopIteration as stop:
                measured = stop.value
            for i, mib, share in held:
                arm = measured[i]
                table_pred = predict_rows(routing, [mib], model, (share,))[0].tps[0]
                own_pred = model.tps(arm.upload_gib, arm.cpu_gib, share)
                rows.append((link, mib, share, arm.tps, table_pred, own_pred))
        print(f"\n{'link GB/s':>9} {'cache MiB':>9} {'share':>5} {'measured':>9} {'tuner':>7} {'err':>7} "
              f"{'own traffic':>11} {'err':>7}")  # fmt: skip
        for link, mib, share, got, pred, own in rows:
            print(f"{link:>9g} {mib:>9g} {share:>5g} {got:>9.1f} {pred:>7.1f} {100 * (pred / got - 1):>+6.1f}% "
                  f"{own:>11.1f} {100 * (own / got - 1):>+6.1f}%")  # fmt: skip
        print(f"load average {os.getloadavg()[0]:.2f}")
        lm.close()


if __name__ == "__main__":
    main()
