"""numba, set up once for the engine: where compiled kernels are cached, and how many threads they use.

Kernels compile on first use (LLVM, for this machine's CPU) and are cached on disk, so later
runs load them in well under a second. The cache lives in moechat's cache folder (platformdirs;
`NUMBA_CACHE_DIR` overrides it), not beside the installed sources, which may be read-only.

numba checks a cached kernel against its own source file only, while a kernel also inlines the
block decoders of another file: the cache folder is therefore named after a hash of every file
that kernels are compiled from (the codes they share with models included: kernels read no model
code, so editing a model recompiles nothing) and of the instruction level they are built for
(kernels/isa.py), and folders of other hashes are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import platformdirs

KERNEL_SOURCES = (
    "jit.py", "isa.py", "llvm_ir.py", "qblocks.py", "qtiles.py", "qtiles8.py", "cpu.py", "attention_core.py",
    "layer_halves.py", "moe_token.py", "codes.py", "../gguf/codebooks.py", "../cache/lru_core.py", "../cache/rules.py",
)  # fmt: skip


def _default_cache_dir() -> Path:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in KERNEL_SOURCES:
        digest.update((here / name).read_bytes())
    digest.update(os.environ.get("MOECHAT_CPU_ISA", "").encode())  # each instruction level its own kernels
    root = Path(platformdirs.user_cache_dir("moechat")) / "kernels"
    path = root / digest.hexdigest()[:16]
    if root.is_dir():
        for old in root.iterdir():
            if old != path and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    return path


if "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = str(_default_cache_dir())

import numba  # noqa: E402  (after the cache folder is set: numba reads it at import)
import numba.core.config  # noqa: E402
import numba.core.event  # noqa: E402

# numba imported earlier (pytest's warning filters import it) read no folder and would cache beside
# cpu.py, checked against cpu.py alone: a changed block layout would load stale kernels. Each kernel
# takes the folder when it is decorated, so setting it here still counts.
numba.core.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]  # type: ignore[attr-defined]
from numba import prange, types  # noqa: E402
from numba.core.errors import NumbaIRAssumptionWarning  # noqa: E402
from numba.extending import intrinsic, overload  # noqa: E402

# numba's own pedantic check on the IR of inlined functions, not a problem of ours: its text would
# reach the user's terminal on every first compile.
warnings.filterwarnings("ignore", category=NumbaIRAssumptionWarning)

__all__ = ["intrinsic", "njit", "overload", "prange", "types"]


def njit(*args: Any, **kwargs: Any) -> Any:
    """numba.njit with the engine's defaults: cached on disk, fast math, the GIL released."""
    kwargs.setdefault("cache", True)
    kwargs.setdefault("fastmath", True)
    kwargs.setdefault("nogil", True)
    return numba.njit(*args, **kwargs)


def set_kernel_threads(n: int) -> int:
    """Threads of the parallel kernels for the calling thread (numba's setting is per thread)."""
    n = max(1, min(n, int(numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
    numba.set_num_threads(n)
    return n


def concurrent_calls_safe() -> bool:
    """Whether two threads may run parallel kernels at once (numba's workqueue layer may not)."""
    try:
        return numba.threading_layer() != "workqueue"
    except ValueError:  # no parallel kernel has run yet: the layer is not chosen
        return numba.config.THREADING_LAYER in ("omp", "tbb", "safe")  # type: ignore[attr-defined]


def compile_line(n: int) -> str:
    """A first start's progress in words a user knows: how many kernels are compiled so far. No total: the
    kernels a model needs are known only once compiled, and a total estimated from another model's first
    start drifted as the count went past it ("of about 200", then 231)."""
    return f"compiling kernels for this model (first start only, a minute or two on 2 cores): {n} compiled"


class CompileCount(numba.core.event.Listener):
    """Counts the kernels numba compiles (not those it loads from its disk cache), saying each one."""

    def __init__(self, note: Callable[[str], None] | None) -> None:
        self.note = note
        self.started = 0

    def on_start(self, event: Any) -> None:
        self.started += 1
        if self.note is not None:
            self.note(compile_line(self.started))

    def on_end(self, event: Any) -> None:
        pass


@contextlib.contextmanager
def compile_notes(note: Callable[[str], None] | None) -> Iterator[CompileCount]:
    """Count, and say with `note`, each kernel numba compiles while the block runs: a first start compiles
    for a minute or two, and says how far it is instead of going quiet."""
    listener = CompileCount(note)
    with numba.core.event.install_listener("numba:compile", listener):
        yield listener
