"""`moechat serve --parallel N`: N concurrent streaming clients against one alone, same server, alternating rounds.

    python bench/serve_many.py [--model MODEL.gguf | --demo] [--parallel 4] [--rounds 3] [--tokens 64]

Each round sends one client's greedy streamed completion alone, then N clients at once, each with a prompt of
its own (the first is the lone client's prompt, so its text alone and among the others can be compared; the
rounds' prompts differ, so no round resumes another's). Decode t/s alone is the engine's formula (tokens after
the first over the time since the first); the N clients' aggregate is every token after each client's first
over the time from the earliest first token to the last token. Prints each round, the medians, their ratio,
whether the texts matched, the expert bytes a decode step reads (where the model's file says), and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from serve import bench_model, start_server  # (bench/serve.py: the same model and server start)

TOPICS = ("the sea and its tides", "a mountain village in winter", "how bread is baked", "the planets of the sun",
          "a train journey at night", "the life of bees", "an old lighthouse", "a market in spring")  # fmt: skip


def stream(url: str, prompt: str, n: int) -> tuple[list[float], str]:
    """The arrival time of each piece of one streamed greedy chat completion, and its text."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0, "stream": True}
    times, text = [], []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            piece = d["choices"][0]["delta"].get("content") if d["choices"] else None
            if piece:
                times.append(time.perf_counter())
                text.append(piece)
    return times, "".join(text)


def alone_tps(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def together(url: str, prompts: list[str], n: int) -> tuple[float, float, list[str]]:
    """The N clients' aggregate decode t/s (over the span from the first token to the last; and as the sum of
    each client's own decode t/s) and their texts."""
    out: list[tuple[list[float], str]] = [([], "")] * len(prompts)

    def one(i: int) -> None:
        out[i] = stream(url, prompts[i], n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    firsts = [t[0][0] for t in out if t[0]]
    lasts = [t[0][-1] for t in out if t[0]]
    tokens = sum(max(0, len(t[0]) - 1) for t in out)
    span = max(lasts) - min(firsts)
    return (tokens / span if span > 0 else 0.0), sum(alone_tps(t[0]) for t in out), [t[1] for t in out]


def step_bytes(model: str | None) -> str:
    """An expert's bytes and the experts a token routes to, from the file: what one token's experts read."""
    if model is None:
        return ""
    from moechat.engine.gguf.reader import GGUFFile

    f = GGUFFile(Path(model))
    layers = [n for n in f.tensors if n.endswith("ffn_down_exps.weight")]
    if not layers:
        return ""
    n_expert = next((int(v) for key, v in f.metadata.items() if key.endswith(".expert_count")), 0)
    k = next((int(v) for key, v in f.metadata.items() if key.endswith("expert_used_count")), 0)
    per = sum(f.tensors[layers[0].replace("down", p)].n_bytes for p in ("gate", "up", "down")) / max(n_expert, 1)
    f.close()
    total = len(layers) * k * per / 2**30
    return f"{len(layers)} MoE layers x {k} experts x {per / 2**20:.2f} MiB = {total:.2f} GiB a token"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--demo", action="store_true", help="the built-in demo")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("flags", nargs="*", help="more flags for the server (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model if args.demo or args.model else bench_model(Path(tmp))
        flags = ["--temp", "0", "-c", "2048", "--parallel", str(args.parallel), *args.flags]
        proc, url = start_server(model, flags)
        rows = []
        try:
            stream(url, "Say hello.", 8)  # the first request's one-time costs out of the rounds
            for i in range(args.rounds):
                prompts = [f"Round {i}. Write about {TOPICS[(i + j) % len(TOPICS)]}." for j in range(args.parallel)]
                t_alone, text_alone = stream(url, prompts[0], args.tokens)
                agg, each, texts = together(url, prompts, args.tokens)
                one = alone_tps(t_alone)
                same = texts[0] == text_alone
                rows.append((one, agg, same, each))
                print(f"round {i + 1}: alone {one:.1f} t/s, {args.parallel} together {agg:.1f} t/s over the span "
                      f"({agg / one:.2f}x), {each:.1f} summed ({each / one:.2f}x), first client's text "
                      f"{'the same' if same else 'DIFFERS'}", flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)
    one, agg = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    each = statistics.median(r[3] for r in rows)
    name = Path(model).name if model else "demo"
    print(f"\n{'model':<28} {'clients':>7} {'alone t/s':>10} {'span t/s':>9} {'ratio':>6} {'summed t/s':>11} "
          f"{'ratio':>6} {'texts':>6}")  # fmt: skip
    print(f"{name:<28} {args.parallel:>7} {one:>10.1f} {agg:>9.1f} {agg / one:>6.2f} {each:>11.1f} {each / one:>6.2f} "
          f"{'same' if all(r[2] for r in rows) else 'differ':>6}")  # fmt: skip
    spent = step_bytes(model)
    if spent:
        print(f"experts read per token alone: {spent}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
