"""Generation speed with the Textual app on vs headless, same model and prompt, alternating runs.

    python bench/tui_overhead.py [--model MODEL.gguf] [--tokens 96] [--rounds 3]

Headless: engine.generate() on the main thread, as `moechat run` does, on a model loaded afresh for
the round (a cold expert cache, as each `moechat run` starts; a cache kept warm from earlier rounds
made headless look up to 10% faster than the app, whose engine process also starts cold). TUI: the full app
(headless terminal via App.run_test) with its engine process and the live dashboard, the reply
typed in and streamed through Markdown. Both greedy, same cache; reports generation t/s of each
round and the ratio. The generated model has no end-of-generation token in its routing path,
so both write the full --tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.app.engine_api import RealEngine
from moechat.app.paths import AppPaths
from moechat.app.screens.chat import ChatScreen
from moechat.app.settings import Settings
from moechat.app.tui import MoechatApp, real_engine_factory
from moechat.engine.expert_cache import CacheSettings
from moechat.engine.generate import GREEDY, DoneEvent, generate
from moechat.engine.loader import load_model

MIB = 64
PROMPT = "Write a long story about a lighthouse keeper and the ships he watched."


def headless(path: Path, n: int) -> float:
    lm = load_model(path, n_ctx=1024, cache=CacheSettings(mib=MIB))
    engine = RealEngine(lm, CacheSettings())
    try:
        prompt, _, _ = engine.fit_messages([{"role": "user", "content": PROMPT}])
        for ev in generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=n, params=GREEDY,
                           ignore_eos=True):  # fmt: skip
            if isinstance(ev, DoneEvent):
                return ev.gen_tps
        raise RuntimeError("no DoneEvent")
    finally:
        engine.close()


def with_tui(path: Path, n: int, home: Path) -> tuple[float, float]:
    """Generation t/s in the app, and the UI process's CPU use (cores) while it streamed."""
    paths = AppPaths(home / "c", home / "d", home / "k", home / "l")
    settings = Settings(n_predict=n, temp=0.0, moe_cache_mib=MIB, ctx_size=1024, device="cpu")
    # The app's own engine: the model in a child process, as `moechat` runs it.
    app = MoechatApp(real_engine_factory(str(path), settings, None), settings, paths=paths)
    result: list[float] = []

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            while not (isinstance(app.screen, ChatScreen) and app.focused is not None and app.focused.id == "input"):
                await pilot.pause(0.05)
            screen = app.screen
            screen.query_one("#input").load_text(PROMPT)
            cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            await pilot.press("enter")
            while len(screen.conv.messages) < 2 or screen.generating:
                await asyncio.sleep(0.05)
            cpu1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            ui = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / (t1 - t0)
            result.append(screen.conv.messages[-1]["stats"]["gen_tps"])
            result.append(ui)

    asyncio.run(run())
    return result[0], result[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
        else:
            from testkit.ggufgen import tiny_moe

            path = tiny_moe(Path(tmp) / "bench.gguf", n_layers=8, n_embd=512, n_expert=32, n_expert_used=4,
                            n_ff_exp=512, n_vocab=4096)  # fmt: skip
        rows = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            a = headless(path, args.tokens)
            b, ui = with_tui(path, args.tokens, Path(tmp) / f"h{r}")
            rows.append((a, b))
            print(f"round {r + 1}: headless {a:6.1f} t/s, TUI {b:6.1f} t/s, ratio {b / a:.3f}, UI process CPU "
                  f"{100 * ui:.0f}% of a core "
                  f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        ratios = [b / a for a, b in rows]
        print(f"\n{path.name}: TUI / headless generation t/s, median of {len(rows)}: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
