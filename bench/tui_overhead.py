"""Generation speed with the Textual app on vs headless, same model and prompt, alternating runs.

    python bench/tui_overhead.py [--model MODEL.gguf | --demo] [--tokens 96] [--rounds 3] [--threads N]

--demo: the built-in demo with the settings `moechat` gives it (its fp32 expert cache, its expert
cache and CPU share); a generated model or --model runs with a 64 MiB cache.

Headless: the engine's reply (generate() behind the app's stop strings) on the main thread, as
`moechat run` generates, on a model loaded afresh for
the round (a cold expert cache, as each `moechat run` starts; a cache kept warm from earlier rounds
made headless look up to 10% faster than the app, whose engine process also starts cold). TUI: the full app
(headless terminal via App.run_test) with its engine process and the live dashboard, the reply
typed in and streamed through Markdown. Both greedy through the same reply path (stop strings,
end of generation), same cache; the two must write the same number of tokens; which goes first alternates. Reports
generation t/s of each round and the ratio. The app runs in a process of its own, as `moechat` does: it lowers its
UI's priority once its engine runs (app/engine_process.py), which must not slow the headless rounds here.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.app.demo_model import resolve_model
from moechat.app.paths import AppPaths
from moechat.app.real_engine import RealEngine
from moechat.app.screens.chat import ChatScreen
from moechat.app.settings import Settings, for_demo
from moechat.app.tui import MoechatApp, real_engine_factory
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.events import GREEDY, DoneEvent
from moechat.engine.loader import load_model, set_threads

MIB = 64  # the expert cache of a generated or given model
# A prompt that asks for a long reply: a reply cut short would time a cold start, not the steady
# rate (the tokens written are printed with the rates).
PROMPT = "Write a long essay about the history of the city of Rome, from its founding to the present day."


def headless(path: Path, n: int, base: Settings, prompt_text: str) -> tuple[float, int]:
    """Generation t/s and tokens written, through the same reply path as the app (stop strings, EOS)."""
    cache = CacheSettings(mib=base.moe_cache_mib, cpu_share=base.moe_cache_cpu_share)
    lm = load_model(path, n_ctx=1024, cache=cache, cpu_dequant_mib=base.cpu_dequant_mib)
    engine = RealEngine(lm, CacheSettings())
    try:
        prompt, _, _ = engine.fit_messages([{"role": "user", "content": prompt_text}])
        for ev in engine.reply(prompt, GREEDY, n, threading.Event()):
            if isinstance(ev, DoneEvent):
                return ev.gen_tps, ev.n_generated
        raise RuntimeError("no DoneEvent")
    finally:
        engine.close()


def with_tui(path: Path, n: int, home: Path, base: Settings, prompt_text: str) -> tuple[float, int, float]:
    """Generation t/s and tokens written in the app, and the UI process's CPU use (cores) while it streamed."""
    paths = AppPaths(home / "c", home / "d", home / "k", home / "l")
    settings = replace(base, n_predict=n, temp=0.0, ctx_size=1024, device="cpu")
    # The app's own engine: the model in a child process, as `moechat` runs it.
    app = MoechatApp(real_engine_factory(str(path), settings, None), settings, paths=paths)
    result: list[float] = []

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            while not (isinstance(app.screen, ChatScreen) and app.focused is not None and app.focused.id == "input"):
                await pilot.pause(0.05)
            screen = app.screen
            screen.query_one("#input").load_text(prompt_text)
            cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            await pilot.press("enter")
            while len(screen.conv.messages) < 2 or screen.generating:
                await asyncio.sleep(0.05)
            cpu1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            ui = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / (t1 - t0)
            stats = screen.conv.messages[-1]["stats"]
            result.extend([stats["gen_tps"], stats["n_generated"], ui])

    asyncio.run(run())
    return result[0], int(result[1]), result[2]


def _call_into(q: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    q.put(fn(*args))


def in_own_process(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a fresh (non-daemonic: it starts an engine process of its own) child process."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_call_into, args=(q, fn, args))
    p.start()
    out = q.get()
    p.join()
    return out


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None)
    ap.add_argument("--demo", action="store_true", help="the built-in demo, with its default fp32 expert cache")


def bench_model(args: argparse.Namespace, tmp: str) -> tuple[Path, Settings]:
    """The model the flags name and the app's settings for it: the demo with its own defaults,
    a given file, or (neither) a generated MoE written into `tmp`, with a MIB expert cache."""
    if args.demo:
        return resolve_model(None), for_demo(Settings(), None)
    if args.model:
        return Path(args.model), Settings(moe_cache_mib=MIB)
    from testkit.ggufgen import tiny_moe

    path = tiny_moe(Path(tmp) / "bench.gguf", n_layers=8, n_embd=512, n_expert=32, n_expert_used=4, n_ff_exp=512,
                    n_vocab=4096)  # fmt: skip
    return path, Settings(moe_cache_mib=MIB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="the engine's intra-op threads on both sides (0: torch's default, one per core); "
                         "fewer than the cores leaves the UI a core of its own")  # fmt: skip
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, base = bench_model(args, tmp)
        # Headless runs in this process, the app's engine in its child (which takes it from the settings).
        base = replace(base, threads=set_threads(args.threads))
        rows = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            # Which side goes first alternates: neither gains from a machine that warms up or slows.
            if r % 2 == 0:
                a, na = headless(path, args.tokens, base, PROMPT)
            b, nb, ui = in_own_process(with_tui, path, args.tokens, Path(tmp) / f"h{r}", base, PROMPT)
            if r % 2 == 1:
                a, na = headless(path, args.tokens, base, PROMPT)
            if na != nb:  # greedy on both sides: the same reply, unless one was cut short
                raise SystemExit(f"headless wrote {na} tokens, the app {nb}: not comparable")
            rows.append((a, b))
            print(f"round {r + 1}: {na} tokens, headless {a:6.1f} t/s, TUI {b:6.1f} t/s, ratio {b / a:.3f}, UI CPU "
                  f"{100 * ui:.0f}% of a core "
                  f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        ratios = [b / a for a, b in rows]
        print(f"\n{path.name}, {base.threads} engine threads: TUI / headless generation t/s, median of {len(rows)}: "
              f"{statistics.median(ratios):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
