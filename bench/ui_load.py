"""What a UI-like CPU load beside the engine costs its decode speed, measured within one run.

    python bench/ui_load.py [--model MODEL.gguf | --demo] [--busy-ms 25] [--period-ms 250] [--runs 3]

The app's engine process (as `moechat` starts it) writes one long greedy reply while another
process alternates, every --phase seconds, between quiet and a load like the app's UI: busy on
the CPU for --busy-ms of every --period-ms (the app draws about 4 times a second, 10 to 25 ms a
frame). Tokens are timed in the parent as they arrive; the t/s of the quiet and the loaded phases
of the same run are compared, so the machine's drift between runs cancels out (bench/tui_overhead.py
compares separate runs, whose speed moves by 10% on a shared machine).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from moechat.app.settings import Settings
from moechat.app.tui import real_engine_factory
from moechat.engine.events import GREEDY, TokenEvent
from tui_overhead import PROMPT, add_model_args, bench_model  # the same prompt and models (bench/ is on the path)

SETTLE = 0.2  # seconds after a phase switch whose tokens count for neither phase


def load(on: Any, stop: Any, busy: float, period: float) -> None:
    """The UI-like load: while `on` is set, busy `busy` s of every `period` s; else asleep."""
    while not stop.is_set():
        if on.is_set():
            t = time.thread_time()
            while time.thread_time() - t < busy:
                pass
            time.sleep(period - busy)
        else:
            on.wait(0.05)


def one_run(
    path: Path, settings: Settings, tokens: int, busy: float, period: float, phase: float
) -> tuple[float, float]:
    """(quiet t/s, loaded t/s) of one reply."""
    ctx = mp.get_context("spawn")
    on, stop = ctx.Event(), ctx.Event()
    loader = ctx.Process(target=load, args=(on, stop, busy, period), daemon=True)
    loader.start()
    engine = real_engine_factory(str(path), settings, None)(lambda text: None)
    switches: list[tuple[float, bool]] = []
    done = threading.Event()

    def toggle() -> None:
        state = False
        while not done.wait(0 if not switches else phase):
            state = not state
            (on.set if state else on.clear)()
            switches.append((time.perf_counter(), state))

    try:
        prompt, _, _ = engine.fit_messages([{"role": "user", "content": PROMPT}])
        arrivals = []
        reply = engine.reply(prompt, GREEDY, tokens, threading.Event())
        for ev in reply:
            if isinstance(ev, TokenEvent):
                arrivals.append(time.perf_counter())
                if len(arrivals) == 4:  # past the prompt and the first tokens: start the phases
                    threading.Thread(target=toggle, daemon=True).start()
    finally:
        done.set()
        stop.set()
        engine.close()
        loader.join(5)
    quiet: list[float] = []
    loaded: list[float] = []
    ends = [t for t, _ in switches[1:]] + [float("inf")]
    for a, b in itertools.pairwise(arrivals):
        for (start, state), end in zip(switches, ends, strict=True):
            if start + SETTLE <= a and b <= end:
                (loaded if state else quiet).append(b - a)
    if not quiet or not loaded:
        raise SystemExit("the reply ended before both phases had tokens: use more --tokens or a shorter --phase")
    return len(quiet) / sum(quiet), len(loaded) / sum(loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--busy-ms", type=float, default=25.0)
    ap.add_argument("--period-ms", type=float, default=250.0)
    ap.add_argument("--phase", type=float, default=1.5, help="seconds of each quiet or loaded phase")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, settings = bench_model(args, tmp)
        settings = replace(settings, ctx_size=1024, device="cpu")
        busy, period = args.busy_ms / 1000, args.period_ms / 1000
        print(f"{path.name}: load {args.busy_ms:g} ms of every {args.period_ms:g} ms "
              f"({100 * busy / period:.0f}% of a core) in alternating {args.phase:g} s phases\n")  # fmt: skip
        print("| run | quiet t/s | loaded t/s | loaded / quiet |\n|---:|---:|---:|---:|")
        ratios = []
        for r in range(args.runs):
            quiet, loaded = one_run(path, settings, args.tokens, busy, period, args.phase)
            ratios.append(loaded / quiet)
            print(f"| {r + 1} | {quiet:.2f} | {loaded:.2f} | {loaded / quiet:.3f} |", flush=True)
        print(f"\nmedian loaded / quiet: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
