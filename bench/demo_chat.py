"""Does the demo chat? The held-out chat prompts answered by the dense source and by the demo.

    python bench/demo_chat.py [--demo smollm2] [--max-tokens 512] [--repeat-penalty 1.0 1.1]

Each of the 20 `held_out_chat` prompts of assets/demo_prompts.json (never used to fit the demo's
recipe) is answered at temperature 0 by the dense source model and by the built demo, with each
repeat penalty given (1.1 is the demo's default). Prints, per model and penalty, how many replies
end on an end-of-turn token rather than the length limit (goal: >= 90% for the demo), the mean
reply length and the decode speed, then the first replies side by side.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os

from moechat.app.paths import app_paths
from moechat.demo.build import DEFAULT_DEMO, DEMOS, ensure_demo
from moechat.engine.events import DoneEvent, SamplingParams, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import LoadedModel, load_model


def answer(lm: LoadedModel, question: str, max_tokens: int, penalty: float) -> tuple[str, DoneEvent]:
    params = SamplingParams(temperature=0.0, repeat_penalty=penalty)
    events = list(generate(lm.model, lm.tokenizer, lm.chat_prompt(question), lm.new_cache(), max_tokens=max_tokens,
                           params=params))  # fmt: skip
    done = events[-1]
    if not isinstance(done, DoneEvent):
        raise RuntimeError("generation ended without its DoneEvent")
    return "".join(e.text for e in events if isinstance(e, TokenEvent)), done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", choices=sorted(DEMOS), default=DEFAULT_DEMO)
    ap.add_argument("--max-tokens", type=int, default=512, help="the app's default reply limit")
    ap.add_argument("--repeat-penalty", type=float, nargs="+", default=[1.0, 1.1])
    ap.add_argument("--show", type=int, default=4, help="replies to print side by side")
    args = ap.parse_args()
    spec = DEMOS[args.demo]
    prompts = json.loads(importlib.resources.files("moechat.assets").joinpath("demo_prompts.json").read_text())
    questions = prompts["held_out_chat"]
    cache = app_paths().cache
    models = {"dense source": spec.source(cache / "sources"), "demo": ensure_demo(cache, name=spec.name)}
    replies: dict[str, list[str]] = {}
    rows = []
    for name, path in models.items():
        lm = load_model(path, n_ctx=1024)
        for penalty in args.repeat_penalty:
            done = [answer(lm, q, args.max_tokens, penalty) for q in questions]
            replies[f"{name}, penalty {penalty:g}"] = [text for text, _ in done]
            ended = sum(d.stop_reason == "eos" for _, d in done)
            tokens = sum(d.n_generated for _, d in done)
            seconds = sum(d.gen_seconds for _, d in done)
            rows.append((f"{name}, penalty {penalty:g}", ended, tokens / len(done), tokens / seconds if seconds else 0))
        lm.close()
    print(f"load average {os.getloadavg()[0]:.2f}; {len(questions)} held-out prompts, temperature 0, "
          f"at most {args.max_tokens} tokens")  # fmt: skip
    print("| model, repeat penalty | replies ending on end-of-turn | mean reply tokens | decode t/s |")
    print("|---|---:|---:|---:|")
    for name, ended, mean, tps in rows:
        print(f"| {name} | {ended}/{len(questions)} ({ended / len(questions):.0%}) | {mean:.0f} | {tps:.1f} |")
    for i, q in enumerate(questions[: args.show]):
        print(f"\n> {q}")
        for name, texts in replies.items():
            print(f"  {name}: {texts[i].strip()[:300]!r}")


if __name__ == "__main__":
    main()
