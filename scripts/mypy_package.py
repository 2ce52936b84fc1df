"""mypy over the package as installed, so that `moechat.*` imports are followed.

`mypy .` checks each folder of the checkout as a top-level package (`app`, `engine`, ...), while the
code imports them as `moechat.app`, `moechat.engine`, ...: those imports resolve only in the installed
layout (setup.py maps each folder to `moechat.<folder>`), so mypy took them as Any. Here a temporary
folder lays the checkout out as installed, through links, and mypy checks `-p moechat` there.

    python scripts/mypy_package.py
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _roots() -> tuple[str, ...]:
    """setup.py's ROOTS (the folders installed as moechat.<folder>), read without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise SystemExit("setup.py declares no ROOTS")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "moechat"
        package.mkdir()
        for f in (ROOT / "moechat").glob("*.py"):
            (package / f.name).symlink_to(f)
        for name in _roots():
            (package / name).symlink_to(ROOT / name, target_is_directory=True)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "moechat"]
        return subprocess.call(cmd, cwd=tmp, env={**os.environ, "MYPYPATH": tmp})


if __name__ == "__main__":
    raise SystemExit(main())
