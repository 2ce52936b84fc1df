"""Look-ahead (`--moe-cache-prefetch`), measured against issue 72's goals, in one run.

    python bench/prefetch.py [--rounds 5] [--tokens 256] [--model PATH] [--skip-speed]

1. Replay: the demo records a trace (a long prompt, `--tokens` generated, greedy), which holds the
   engine's predictions one layer ahead; `moechat sim` replays it with and without prefetch at 10%,
   20% and 30% of the experts: exposed misses against Belady MIN's demand misses, and bytes uploaded
   (demand and prefetch) against the same policy without prefetch.
2. Speed: `moechat run` on the demo with the cache at 25% of its experts (`--moe-cache-mib 68`), with
   an emulated 1 GB/s link and without one: the defaults (`--moe-cache-prefetch auto`) against
   `--moe-cache-prefetch off`, in alternating rounds, medians.
3. Recall per layer: of the experts predicted one layer ahead, the share the layer then selected, on
   the demo's trace and (`--model`, e.g. the 12-layer Qwen3-shaped file) on another model's.
4. Real routing (`../shared/data/real-routing/`, no predictions: demand only): ClassLRU's misses
   against LRU's and MIN's at 10-30%.

Prints the CPU, the load before and after, and a table per part.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPT = (
    "You are reviewing a long technical report about harbour logistics. The report covers crane scheduling, "
    "container stacking, tidal windows, customs inspection, truck arrival slots, rail connections, berth "
    "allocation, pilotage, weather delays, labour shifts, safety audits and energy use. "
) * 6 + "Summarise the report in detail, section by section, and then propose improvements for each section."
REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "real-routing"


def moechat(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "moechat", *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"moechat {' '.join(args[:2])} failed: {out.stderr.strip()[-400:]}")
    return out.stdout + out.stderr


def sim_json(trace: Path, sizes: list[float], *extra: str) -> list[dict[str, Any]]:
    out = moechat("sim", str(trace), "--json", "--sizes", *map(str, sizes), *extra)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def replay_table(trace: Path, full_mib: float) -> None:
    sizes = [round(f * full_mib, 3) for f in (0.1, 0.2, 0.3)]
    rows = sim_json(trace, sizes, "--policy", "classlru", "--prefetch", "off", "next-layer")
    print("| cache | exposed off | exposed next-layer | MIN misses | exposed / MIN | uploaded MiB off | next-layer "
          "| bytes vs off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for i, mib in enumerate(sizes):
        off, on = rows[2 * i], rows[2 * i + 1]
        assert off["prefetch"] == "off" and on["prefetch"] == "next-layer"
        print(
            f"| {100 * (i + 1) * 0.1:.0f}% ({mib:g} MiB) | {off['exposed']} | {on['exposed']} | {on['min_misses']} | "
            f"{on['exposed'] / max(1, on['min_misses']):.2f}x | {off['uploaded_mib']:.0f} | {on['uploaded_mib']:.0f} | "
            f"{on['uploaded_mib'] / max(1e-9, off['uploaded_mib']) - 1:+.0%} |"
        )


def recall_table(trace: Path, name: str) -> None:
    from moechat.tuner.simulator import load_routing, replay

    routing = load_routing(trace)
    res = replay(routing, routing.full_mib(), warmup=0, prefetch="off")
    cells = [f"{100 * c.total.recall:.0f}%" for _, c in sorted(res.layers.items()) if c.total.predicted]
    t = res.total
    print(
        f"{name}: recall {100 * t.recall:.1f}% over {t.predicted} predicted experts; per layer (from the second "
        f"MoE layer): {' '.join(cells)}"
    )


def speed(rounds: int, tokens: int) -> None:
    arms = [("1 GB/s", "defaults", ["--emulate-link-gbps", "1"]),
            ("1 GB/s", "off", ["--emulate-link-gbps", "1", "--moe-cache-prefetch", "off"]),
            ("none", "defaults", []), ("none", "off", ["--moe-cache-prefetch", "off"])]  # fmt: skip
    tps: dict[tuple[str, str], list[float]] = {(a, b): [] for a, b, _ in arms}
    for r in range(rounds):
        for link, mode, extra in arms if r % 2 == 0 else arms[::-1]:
            out = moechat("run", "-p", PROMPT, "-n", str(tokens), "--temp", "0", "--moe-cache-mib", "68", *extra)
            m = re.search(r"generation: \d+ tokens, ([\d.]+) t/s", out)
            if m is None:
                raise SystemExit(f"no decode speed in: {out[-300:]}")
            tps[(link, mode)].append(float(m.group(1)))
    print(f"| link | defaults t/s | off t/s | ratio (medians of {rounds}) | runs defaults | runs off |")
    print("|---|---|---|---|---|---|")
    for link in ("1 GB/s", "none"):
        a, b = tps[(link, "defaults")], tps[(link, "off")]
        print(
            f"| {link} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | "
            f"{statistics.median(a) / statistics.median(b):.2f}x | {' '.join(f'{x:.0f}' for x in a)} | "
            f"{' '.join(f'{x:.0f}' for x in b)} |"
        )


def real_table() -> None:
    from moechat.tuner.baselines import simulate_baseline
    from moechat.tuner.simulator import load_routing, replay

    for csv in sorted(REAL.glob("*.csv")):
        routing = load_routing(csv)
        warm = min(64, routing.n_tokens // 4)
        print(f"\n{csv.name}: {routing.n_tokens} tokens, demand only (no predictions in it)")
        print("| cache | ClassLRU misses | LRU | MIN | ClassLRU / LRU | ClassLRU / MIN |")
        print("|---|---|---|---|---|---|")
        for f in (0.1, 0.2, 0.3):
            mib = f * routing.full_mib()
            slots = routing.slots(mib)
            ours = replay(routing, mib, warmup=warm).total.misses
            lru = simulate_baseline(routing, slots, "lru", warm).misses
            best = simulate_baseline(routing, slots, "min", warm).misses
            print(f"| {100 * f:.0f}% | {ours} | {lru} | {best} | {ours / lru:.2f} | {ours / best:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--model", default=None, help="another model for the recall (e.g. the 12-layer Qwen3-shaped file)")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    from moechat.engine.kernels.isa import describe

    print(f"CPU: {describe()}; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "demo.trace"
        moechat("run", "-p", PROMPT, "-n", str(args.tokens), "--temp", "0", "--moe-cache-mib", "68",
                "--moe-cache-trace", str(trace))  # fmt: skip
        from moechat.tuner.simulator import load_routing

        print(f"1. Replay of the demo's trace ({load_routing(trace).n_tokens} tokens), ClassLRU, share 0")
        replay_table(trace, load_routing(trace).full_mib())
        print("\n3. Recall one layer ahead")
        recall_table(trace, "demo")
        if args.model:
            other = Path(tmp) / "model.trace"
            moechat("run", args.model, "-p", PROMPT, "-n", "64", "--temp", "0", "--moe-cache-mib", "1",
                    "--moe-cache-trace", str(other))  # fmt: skip
            recall_table(other, Path(args.model).name)
    if not args.skip_speed:
        print(f"\n2. Decode speed, demo, cache 68 MiB (25%), {args.tokens} tokens greedy")
        speed(args.rounds, args.tokens)
    print("\n4. Real routing")
    real_table()
    print(f"\nload after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
