"""`moechat serve` against `moechat run`: decode t/s of one streaming client, and the time to the first
token for a long prompt, alternating rounds on the same model and settings.

    python bench/serve.py [--model MODEL.gguf | --demo] [--rounds 4] [--tokens 96] [--prompt-tokens 500]

Each round sends the server one streamed raw completion and runs `moechat run --raw` once, in turn
(which goes first alternates). Both read a prompt of about --prompt-tokens tokens that starts with
the round's number, so no prompt is resumed from an earlier one's KV cache, and both write greedy.
Server: the first token's time is from sending the request to its first piece (HTTP, the queue and
reading the prompt); decode t/s is the engine's formula (tokens after the first over the time since
the first) over the pieces as they arrive. `run`: its own printed prompt time (tokens / t/s) and
decode t/s. Prints a table and the medians' ratios, with the load average.
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
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MOECHAT = [sys.executable, "-m", "moechat"]
TEXT = ("The river ran through the old town, past the mill and the market, under three stone bridges, "
        "and out into the fields where the herons waited. ")  # fmt: skip


def prompt_of(round_: int, n_tokens: int) -> str:
    # About four characters a token for this prose.
    return f"Round {round_}. " + TEXT * max(1, n_tokens * 4 // len(TEXT))


def bench_model(folder: Path) -> str:
    """The small MoE the benches serve without --model or --demo (written by the test kit)."""
    from testkit.ggufgen import tiny_moe

    return str(tiny_moe(folder / "bench.gguf", n_layers=8, n_embd=512, n_expert=32, n_expert_used=4, n_ff_exp=512,
                        n_vocab=4096))  # fmt: skip


def start_server(model: str | None, flags: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [*MOECHAT, "serve", *([model] if model else []), "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if m:
            return proc, m.group(1)
    raise SystemExit(f"the server did not start: {proc.wait()}")


def served(url: str, prompt: str, n: int) -> tuple[float, float, int]:
    """(seconds to the first token, decode t/s, tokens) of one streamed greedy completion."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first = last = 0.0
    pieces, tokens = 0, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
            if d["choices"] and d["choices"][0]["text"]:
                now = time.perf_counter()
                first = first or now
                last = now
                pieces += 1
    # One piece a token (a piece holds more only where a stop string is held back: none here).
    tps = (pieces - 1) / (last - first) if pieces > 1 and last > first else 0.0
    return first - t0, tps, tokens


def ran(model: str | None, prompt: str, n: int, flags: list[str]) -> tuple[float, float, int]:
    """(prompt seconds, decode t/s, tokens) as `moechat run --raw` prints them."""
    r = subprocess.run([*MOECHAT, "run", *([model] if model else []), "--raw", "-p", prompt, "-n", str(n), *flags],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    m = re.search(r"prompt: (\d+) tokens, ([\d.]+) t/s \| generation: (\d+) tokens, ([\d.]+) t/s", r.stderr)
    if m is None:
        raise SystemExit(f"moechat run said: {r.stderr[-2000:]}")
    return int(m[1]) / float(m[2]), float(m[4]), int(m[3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--demo", action="store_true", help="the built-in demo, with its own defaults")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model if args.demo or args.model else bench_model(Path(tmp))
        flags = ["--temp", "0", "-c", "2048"]
        proc, url = start_server(model, flags)
        rows = []
        try:
            served(url, prompt_of(-1, 32), 8)  # one request through first, as `run`'s load runs a token
            for i in range(args.rounds):
                prompt = prompt_of(i, args.prompt_tokens)
                order = ("serve", "run") if i % 2 == 0 else ("run", "serve")
                got = {}
                for side in order:
                    if side == "serve":
                        got[side] = served(url, prompt, args.tokens)
                    else:
                        got[side] = ran(model, prompt, args.tokens, flags)
                rows.append(got)
                (s_first, s_tps, s_n), (r_first, r_tps, r_n) = got["serve"], got["run"]
                print(f"round {i + 1}: first token {s_first:.3f} s served / {r_first:.3f} s run's prompt, decode "
                      f"{s_tps:.1f} / {r_tps:.1f} t/s, tokens {s_n} / {r_n}", flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(30)
    ttft = statistics.median(r["serve"][0] for r in rows) / statistics.median(r["run"][0] for r in rows)
    tps = statistics.median(r["serve"][1] for r in rows) / statistics.median(r["run"][1] for r in rows)
    print(f"\n{'model':<28} {'first token served / run prompt':>32} {'decode served / run':>20}")
    name = Path(model).name if model else "demo"
    print(f"{name:<28} {ttft:>32.3f} {tps:>20.3f}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
