"""A chat of several turns through the app's engine: prompt tokens read and time to the first token per turn.

With the conversation's KV cache kept across replies each turn reads only what it appended, so the
wait for the first token stays flat as the chat grows; `--fresh` starts every turn from an empty
cache (the way before), for comparison in the same run.

    python bench/chat_turns.py [--model M.gguf] [--turns 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

from moechat.app.demo_model import resolve_model
from moechat.app.real_engine import RealEngine
from moechat.app.settings import Settings, cache_settings, for_demo
from moechat.engine.events import DoneEvent, SamplingParams, TokenEvent
from moechat.engine.loader import load_model

QUESTIONS = [
    "Tell me about the sea.",
    "What lives in it?",
    "How deep is it at its deepest?",
    "Why is it salty?",
    "What makes the waves?",
    "Who first sailed across it?",
]


def chat(engine: RealEngine, turns: int, tokens: int, fresh: bool) -> list[tuple[int, int, float]]:
    """(prompt tokens read, kept, seconds to the first token) per turn."""
    messages: list[dict[str, str]] = []
    rows = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        prompt, _, _ = engine.fit_messages(messages)
        if fresh:
            engine.prompts.clear()
        t0 = time.perf_counter()
        first = None
        text = ""
        done = None
        for ev in engine.reply(prompt, SamplingParams(temperature=0.0, repeat_penalty=1.1), tokens,
                               threading.Event()):  # fmt: skip
            if isinstance(ev, TokenEvent):
                first = first if first is not None else time.perf_counter() - t0
                text += ev.text
            elif isinstance(ev, DoneEvent):
                done = ev
        assert done is not None
        rows.append((done.n_prompt, done.n_kept, first or 0.0))
        messages.append({"role": "assistant", "content": text.strip()})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the built-in demo)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48, help="reply tokens per turn")
    args = ap.parse_args()
    path = Path(resolve_model(args.model))
    settings = for_demo(Settings(device="cpu"), args.model)
    cache = cache_settings(settings)
    lm = load_model(path, n_ctx=4096, cache=cache)
    engine = RealEngine(lm, cache)
    chat(engine, 1, 4, fresh=True)  # warm-up: kernels loaded, pages touched
    results = {name: chat(engine, args.turns, args.tokens, fresh) for name, fresh in (("kept", False),
                                                                                        ("fresh", True))}  # fmt: skip
    engine.close()
    print(f"{path.name}, {args.turns} turns, {args.tokens} reply tokens each; load average {os.getloadavg()[0]:.2f}")
    print("| turn | kept: read / kept tokens | kept: first token s | fresh: read tokens | fresh: first token s |")
    print("|---|---|---|---|---|")
    for i, (k, f) in enumerate(zip(results["kept"], results["fresh"], strict=True)):
        print(f"| {i + 1} | {k[0]} / {k[1]} | {k[2]:.3f} | {f[0]} | {f[2]:.3f} |")
    k2, k4 = results["kept"][1][2], results["kept"][-1][2]
    print(f"kept: turn {args.turns} / turn 2 time to first token = {k4 / k2:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
