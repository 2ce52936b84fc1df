"""Whether this thread's few-row ops may take their compiled calls, or torch's eager path only.

A first start answers from the exact path while the fast kernels compile in a helper process
(engine/models/first_start.py): the RMS norm, the one-token attention and the routing of a few rows then run
as torch ops too, so that the answer waits for no compile. Per thread: the fast model that loads in the
background beside it compiles (or loads) its kernels as usual.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


def compiled_ok() -> bool:
    """Whether the calling thread may run compiled few-row ops."""
    return not getattr(_state, "eager", False)


@contextlib.contextmanager
def eager_only() -> Iterator[None]:
    """Within the block, this thread's few-row ops take torch's path (no kernel is compiled or loaded)."""
    before = getattr(_state, "eager", False)
    _state.eager = True
    try:
        yield
    finally:
        _state.eager = before
