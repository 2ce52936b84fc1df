"""Warm start on the demo: the hit rate over the first decode tokens of a new session, cold and warm.

    python bench/warm_start.py [--sessions 4] [--tokens 64]

The demo runs with its default cache (half the routed experts, CPU share 0.5). Each of the first
`--sessions` held-out chat prompts (assets/demo_prompts.json) is one earlier session: it runs on a
cache that warm-starts from the file the sessions before it left, and leaves its counts at exit,
as the app does. Then every remaining held-out prompt is answered twice as the first reply of a new
session, once cold and once warm-started from that file, at temperature 0 (the same tokens either
way), and the hit rate over its first `--tokens` decode tokens is compared. Prints a table with the
machine's load.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from moechat.app.paths import app_paths
from moechat.app.settings import DEMO_DEFAULTS
from moechat.demo.build import DEFAULT_DEMO, DEMOS, ensure_demo
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.cache.stats import CountersSnapshot
from moechat.engine.events import SamplingParams, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import load_model


def first_tokens_hit_rate(path: Path, settings: CacheSettings, question: str, n_decode: int) -> tuple[float, int]:
    """(hit rate over the first n decode tokens, experts preloaded) of one reply in a fresh session."""
    lm = load_model(path, n_ctx=1024, cache=settings)
    if lm.cache is None:
        raise RuntimeError("the demo runs without an expert cache")
    warm = lm.cache.snapshot().warm_uploads
    start: CountersSnapshot | None = None
    end = CountersSnapshot()
    params = SamplingParams(temperature=0.0)
    for ev in generate(lm.model, lm.tokenizer, lm.chat_prompt(question), lm.new_cache(), max_tokens=n_decode + 1,
                       params=params, ignore_eos=True):  # fmt: skip
        if isinstance(ev, TokenEvent) and ev.index == 0:
            start = lm.cache.snapshot().total  # the prompt read (a bypassing batch): decode starts here
    end = lm.cache.snapshot().total
    lm.close()
    d = end - (start or CountersSnapshot())
    return d.hit_rate, warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", choices=sorted(DEMOS), default=DEFAULT_DEMO)
    ap.add_argument("--sessions", type=int, default=4, help="earlier sessions that leave the counts")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens scored per reply")
    ap.add_argument("--replies", type=int, default=8, help="new-session replies measured")
    args = ap.parse_args()
    spec = DEMOS[args.demo]
    path = ensure_demo(app_paths().cache, name=spec.name)
    questions = json.loads(importlib.resources.files("moechat.assets").joinpath("demo_prompts.json").read_text())
    held = questions["held_out_chat"]
    with tempfile.TemporaryDirectory() as tmp:
        warm_file = Path(tmp) / "warm.json"
        demo = DEMO_DEFAULTS.get(spec.name, {})
        base = CacheSettings(mib=float(demo.get("moe_cache_mib", 137.0)),
                             cpu_share=float(demo.get("moe_cache_cpu_share", 0.5)), warm_start=warm_file)  # fmt: skip
        for q in held[: args.sessions]:  # earlier sessions, each leaving its counts at exit
            lm = load_model(path, n_ctx=1024, cache=base)
            for _ in generate(lm.model, lm.tokenizer, lm.chat_prompt(q), lm.new_cache(), max_tokens=128,
                              params=SamplingParams(temperature=0.0)):  # fmt: skip
                pass
            lm.close()
        cold_settings = CacheSettings(mib=base.mib, cpu_share=base.cpu_share)
        rows = []
        for q in held[args.sessions : args.sessions + args.replies]:
            cold, _ = first_tokens_hit_rate(path, cold_settings, q, args.tokens)
            run = Path(tmp) / "run.json"  # a copy: a measured run's exit must not change what the next reads
            shutil.copy(warm_file, run)
            warm, n_warm = first_tokens_hit_rate(path, dataclasses.replace(base, warm_start=run), q, args.tokens)
            rows.append((q, cold, warm, n_warm))
    print(
        f"load average {os.getloadavg()[0]:.2f}; demo {spec.name}, cache {base.mib:g} MiB, CPU share "
        f"{base.cpu_share:g}; {args.sessions} earlier sessions; hit rate over the first {args.tokens} decode tokens"
    )
    print("| new session's first prompt | cold | warm start | experts preloaded |\n|---|---:|---:|---:|")
    for q, cold, warm, n in rows:
        print(f"| {q[:48]} | {100 * cold:.1f}% | {100 * warm:.1f}% | {n} |")
    cold_mean, warm_mean = (statistics.mean(r[i] for r in rows) for i in (1, 2))
    print(f"| mean | {100 * cold_mean:.1f}% | {100 * warm_mean:.1f}% | |")


if __name__ == "__main__":
    main()
