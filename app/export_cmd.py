"""`moechat export`: the stats of the last (or a given) app session as JSON, CSV or Markdown (with `-o`, its
charts also as SVG pictures beside the Markdown)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moechat.app.export import read_stats, write_stats
from moechat.app.paths import app_paths


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("session", nargs="?", help="a session stats file (default: the latest session)")
    p.add_argument("-f", "--format", choices=("json", "csv", "md"), default="md", help="output format (default md)")
    p.add_argument("-o", "--output", default=None, metavar="PATH", help="file to write (default: stdout)")


def latest_session() -> Path:
    folder = app_paths().data / "sessions"
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise ValueError(f"no saved sessions in {folder}: chat in the app first, or name a stats file")
    return files[-1]


def run_export(args: argparse.Namespace) -> int:
    path = Path(args.session) if args.session else latest_session()
    d = read_stats(path)
    if args.output:
        out = write_stats(d, Path(args.output), args.format)
        print(f"moechat: wrote {', '.join(str(p) for p in out)}", file=sys.stderr)
        return 0
    from moechat.app.export import to_csv, to_markdown

    text = {
        "json": lambda: __import__("json").dumps(d, indent=1),
        "csv": lambda: to_csv(d),
        "md": lambda: to_markdown(d),
    }
    sys.stdout.write(text[args.format]() + ("\n" if args.format == "json" else ""))
    return 0
