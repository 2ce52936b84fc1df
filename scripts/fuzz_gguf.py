"""The long GGUF fuzz run: N mutated files per kind through the parser, config and model build.

    python scripts/fuzz_gguf.py [--per-kind 200] [--seed 0]

Prints a table per mutation kind: files, clean errors, files that still open, slowest parse,
and any failure that was not a clean ValueError (which is a bug to fix).
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from moechat.engine.loader import load_model
from testkit.gguf_fuzz import KINDS, mutate
from testkit.gguf_layout import layout
from testkit.ggufgen import tiny_moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-kind", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_path = tiny_moe(Path(tmp) / "base.gguf", n_layers=1, n_embd=32, n_head=2, n_ff_exp=32, n_expert=4,
                             n_vocab=300)  # fmt: skip
        base = base_path.read_bytes()
        lay = layout(base)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"{'kind':<14}{'files':>6}{'errors':>8}{'open':>6}{'slowest s':>10}  bugs")
        total = bugs = 0
        for kind in KINDS:
            rng = random.Random(f"{args.seed}-{kind}")
            errors = ok = 0
            slowest = 0.0
            found = []
            for i in range(args.per_kind):
                path = Path(tmp) / "m.gguf"
                path.write_bytes(mutate(base, lay, rng, kind))
                t = time.monotonic()
                try:
                    lm = load_model(path, n_ctx=32)
                    lm.close()
                    ok += 1
                except ValueError:
                    errors += 1
                except Exception as e:  # anything else is a bug: it would be a traceback for the user
                    found.append(f"#{i}: {type(e).__name__}: {e}")
                slowest = max(slowest, time.monotonic() - t)
            total += args.per_kind
            bugs += len(found)
            print(f"{kind:<14}{args.per_kind:>6}{errors:>8}{ok:>6}{slowest:>10.3f}  {len(found)}")
            for line in found[:5]:
                print(f"    {line}")
        rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        print(f"\n{total} files, {bugs} bugs, peak RSS grew {rss:.0f} MiB")


if __name__ == "__main__":
    main()
