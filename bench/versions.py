"""Two versions of moechat side by side: `moechat run` decode speed and greedy text, alternating.

A change that should not change behaviour or speed (a refactor) is checked here: each round runs
every setting with this checkout and with the other code (`--other PYTHONPATH`, e.g. a folder
holding the code before the change as `moechat/`), one process each, and the table gives the
median t/s of each and their ratio, and whether the generated text was the same.

    python bench/versions.py --other /tmp/old --rounds 3
    python bench/versions.py --other /tmp/old --model MODEL.gguf   # that file, cache off, instead of the demo
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

SETTINGS = {
    "demo, cache off": ["--moe-cache-mib", "0"],
    "demo, its default cache": [],
    "demo, cache 137 MiB, share 0": ["--moe-cache-mib", "137", "--moe-cache-cpu-share", "0"],
}
PROMPT = "Tell me about the sea."


def one_run(python_path: str | None, flags: list[str], tokens: int) -> tuple[float, str]:
    env = {**os.environ}
    if python_path:
        env["PYTHONPATH"] = python_path
        # Its own kernel cache: each version clears cache folders of other kernel sources.
        env["NUMBA_CACHE_DIR"] = os.path.join(python_path, ".numba-cache")
    cmd = [sys.executable, "-m", "moechat", "run", "-p", PROMPT, "-n", str(tokens), "--temp", "0", "--ignore-eos",
           *flags]  # fmt: skip
    # Run outside the checkout: there `python -m moechat` would find the checkout's own package first.
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tempfile.gettempdir())
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    m = re.search(r"generation: \d+ tokens, ([\d.]+) t/s", r.stderr)
    if m is None:
        raise RuntimeError("no t/s in:\n" + r.stderr[-2000:])
    return float(m.group(1)), r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, metavar="PYTHONPATH", help="where the other version's moechat is")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", help="a GGUF file to run with the cache off, instead of the demo's settings")
    args = ap.parse_args()
    settings = {f"{os.path.basename(args.model)}, cache off": [args.model, "--moe-cache-mib", "0"]} if args.model \
        else SETTINGS  # fmt: skip
    versions = {"this": None, "other": args.other}
    tps: dict[tuple[str, str], list[float]] = {}
    texts: dict[tuple[str, str], set[str]] = {}
    loads = []
    for path in versions.values():  # compiles each version's kernels before anything is timed
        one_run(path, next(iter(settings.values())), 4)
    for _ in range(args.rounds):
        for name, flags in settings.items():
            for version, path in versions.items():
                t, text = one_run(path, flags, args.tokens)
                tps.setdefault((name, version), []).append(t)
                texts.setdefault((name, version), set()).add(text)
        loads.append(os.getloadavg()[0])
    print(f"load average {min(loads):.2f} to {max(loads):.2f}; {args.rounds} rounds, alternating; t/s median (min-max)")
    print("| setting | this | other | this / other | same greedy text |")
    print("|---|---|---|---|---|")
    for name in settings:
        a, b = tps[(name, "this")], tps[(name, "other")]
        same = texts[(name, "this")] == texts[(name, "other")] and len(texts[(name, "this")]) == 1
        print(f"| {name} | {statistics.median(a):.1f} ({min(a):.1f}-{max(a):.1f}) | "
              f"{statistics.median(b):.1f} ({min(b):.1f}-{max(b):.1f}) | "
              f"{statistics.median(a) / statistics.median(b):.2f} | {same} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
