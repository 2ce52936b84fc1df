"""The UI's CPU while a reply streams, in a fresh chat vs after many turns (the scripted engine).

    python bench/ui_long_chat.py [--turns 25] [--rounds 2] [--shown N]

Each text update relays out the screen, at a cost for every widget in it, so a long chat could
make streaming cost more and more. The log keeps the recent turns only (SHOWN_TURNS); --shown
sets another limit to compare (a large one: every turn kept). The scripted engine writes 150
words at 12.5 tokens a second in paragraphs of 40, in-process, so the UI's own CPU is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import moechat.app.screens.chat as chat
from moechat.app.paths import AppPaths
from moechat.app.settings import Settings
from moechat.app.tui import MoechatApp
from testkit.fake_engine import FakeEngine

VOCAB = [
    "the",
    "a",
    "of",
    "model",
    "expert",
    "cache",
    "layer",
    "token",
    "bread",
    "flour",
    "water",
    "salt",
    "yeast",
    "knead",
    "dough",
    "oven",
    "bake",
    "hour",
]


def reply_words(n: int, rng: random.Random) -> list[str]:
    out = []
    for i in range(n):
        w = " " + rng.choice(VOCAB)
        out.append(w + (".\n\n" if i % 40 == 39 else "," if i % 9 == 8 else ""))
    return out


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def measure(turns_before: int, home: Path) -> float:
    """UI CPU (share of a core) while one reply streams after `turns_before` exchanges."""
    engine = FakeEngine(reply_words(150, random.Random(0)))
    paths = AppPaths(home / "c", home / "d", home / "k", home / "l")
    app = MoechatApp(lambda progress: engine, Settings(refresh_ms=250, n_predict=150), paths=paths)
    async with app.run_test(size=(120, 40)) as pilot:
        while not (isinstance(app.screen, chat.ChatScreen) and app.focused is not None):
            await asyncio.sleep(0.05)
        screen = app.screen
        for i in range(turns_before + 1):
            if i == turns_before:
                engine.delay = 0.08  # the measured reply streams at 12.5 t/s
                c0, t0 = cpu_seconds(), time.perf_counter()
            n = len(screen.conv.messages)
            screen.query_one("#input").load_text(f"question {i}")
            await pilot.press("enter")
            while len(screen.conv.messages) < n + 2 or screen.generating:
                await asyncio.sleep(0.05)  # not pilot.pause(): it visits every widget, as the app does not
        return (cpu_seconds() - c0) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=25, help="exchanges before the measured reply")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shown", type=int, default=None, help="turns the log keeps (default: the app's)")
    args = ap.parse_args()
    if args.shown is not None:
        chat.SHOWN_TURNS = args.shown
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            fresh = asyncio.run(measure(0, Path(tmp) / f"a{r}"))
            long = asyncio.run(measure(args.turns, Path(tmp) / f"b{r}"))
            rows.append((fresh, long))
    print(f"turns kept in the log: {chat.SHOWN_TURNS}\n")
    print(f"| round | UI CPU, first reply | UI CPU, after {args.turns} exchanges | ratio |")
    print("|---:|---:|---:|---:|")
    for i, (a, b) in enumerate(rows, 1):
        print(f"| {i} | {100 * a:.1f}% | {100 * b:.1f}% | {b / a:.2f} |")


if __name__ == "__main__":
    main()
