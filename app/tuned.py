"""Settings tuned for one model: the wizard's and `moechat tune --save`'s cache size and CPU share.

They belong to the model they were measured on, so they are kept per model file (its identity:
a hash of its first 16 MiB and its size, as the warm start keys its use counts), in the data
folder's `tuned/`, and apply only when that file runs: above config.toml (the user's defaults
for every model), below MOECHAT_* variables and flags. config.toml is never written by tuning.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import tomllib
from moechat.app.atomic import write_atomic
from moechat.app.paths import app_paths
from moechat.engine.gguf.identity import file_identity

__all__ = ["file_identity", "identity_of", "read_tuned", "save_tuned", "tuned_path"]

TUNED = ("moe_cache_mib", "moe_cache_cpu_share")


def identity_of(path: Path) -> str | None:
    """The identity of a readable file, else None (a missing or unreadable file has no warm start or
    tuned values; loading it says what is wrong)."""
    return file_identity(path) if path.is_file() and os.access(path, os.R_OK) else None


def tuned_path(identity: str, data: Path | None = None) -> Path:
    return (data or app_paths().data) / "tuned" / f"{identity[:32]}.toml"


def save_tuned(identity: str, model_name: str, mib: float, share: float, data: Path | None = None) -> Path:
    values = {"moe_cache_mib": float(mib), "moe_cache_cpu_share": float(share)}
    name = model_name.replace("\n", " ")
    text = f"# moechat: tuned for {name} (this file's identity {identity[:16]}...)\n"
    text += "".join(f"{k} = {v!r}\n" for k, v in values.items())
    return write_atomic(tuned_path(identity, data), text)


def read_tuned(identity: str, data: Path | None = None) -> tuple[dict[str, Any], Path] | None:
    """The values tuned for the model of `identity`, as the file has them (the settings check them), and
    the file; None when there are none or the file cannot be read as TOML."""
    path = tuned_path(identity, data)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    return {k: raw[k] for k in TUNED if k in raw}, path
