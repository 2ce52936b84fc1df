"""Soak: many turns, thousands of tokens, cache and CPU share on; RSS sampled every 500 tokens.

    python bench/soak.py [--tokens 10000] [--turn 200] [--model MODEL.gguf]

The chat goes through the same RealEngine the app uses (conversation re-rendered each turn, the
oldest turns dropped when the context is full) and the session statistics keep their bounded
time series. Prints RSS at each sample and the growth after the warm-up (the first 1000 tokens).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.app.export import SERIES_MAX, SessionStats
from moechat.app.real_engine import RealEngine
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.events import DoneEvent, SamplingParams, TokenEvent
from moechat.engine.loader import load_model


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10_000)
    ap.add_argument("--turn", type=int, default=200, help="tokens per reply")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            path = Path(args.model)
        else:
            from testkit.ggufgen import tiny_moe

            path = tiny_moe(Path(tmp) / "soak.gguf", n_layers=4, n_expert=16, n_expert_used=2, n_vocab=2048)
        lm = load_model(path, n_ctx=1024, cache=CacheSettings(mib=1.5, cpu_share=0.5))
        engine = RealEngine(lm, CacheSettings())
        session = SessionStats({}, {})
        chat: list[dict[str, str]] = []
        total = turns = dropped_total = 0
        samples: list[tuple[int, float]] = [(0, rss_mib())]
        next_sample = 500
        t0 = time.perf_counter()
        while total < args.tokens:
            chat.append({"role": "user", "content": f"Turn {turns}: tell me more about the river."})
            prompt, dropped, _ = engine.fit_messages(chat)
            dropped_total += dropped
            text = ""
            params = SamplingParams(temperature=0.8, seed=turns)
            for ev in engine.reply(prompt, params, min(args.turn, args.tokens - total), threading.Event()):
                if isinstance(ev, TokenEvent) and ev.token >= 0:
                    text += ev.text
                    total += 1
                    if total % 25 == 0:
                        session.add(engine.snapshot(), total, 0.0)
                    if total >= next_sample:
                        samples.append((total, rss_mib()))
                        next_sample += 500
                elif isinstance(ev, DoneEvent):
                    pass
            chat.append({"role": "assistant", "content": text})
            turns += 1
        dt = time.perf_counter() - t0
        print(f"{total} tokens in {turns} turns, {dt:.0f} s ({total / dt:.1f} t/s); oldest-turn drops: {dropped_total}")
        print(f"{'tokens':>7} {'RSS MiB':>8}")
        for n, r in samples:
            print(f"{n:>7} {r:>8.1f}")
        warm = next(r for n, r in samples if n >= 1000)
        last = samples[-1][1]
        print(f"\nRSS after warm-up {warm:.1f} MiB, at the end {last:.1f} MiB: growth {100 * (last / warm - 1):+.1f}%")
        print(f"time series points kept: {len(session.series)} (bounded at {SERIES_MAX})")
        engine.close()


if __name__ == "__main__":
    main()
