"""A first start that answers at once: the exact path serves while the fast kernels compile.

A model's first start on a machine compiles its CPU kernels (LLVM, a minute or two on two cores:
each large kernel takes 10 to 30 s, most of it numba's own passes, not LLVM's optimiser). Rather
than make the user wait, a first start loads the model a second, slower way that compiles
nothing: dense weights dequantized to float32, experts dequantized by torch (the `exact` kernels,
the reference the fast ones are tested against), torch's ops for the few-row norms, attention
and routing (nn.eager), no expert cache. A helper process (models.compile_ahead) compiles every
kernel the fast path runs into the disk cache meanwhile, and stamps the model kind compiled
when it is through; it outlives a short run, so the next start finds them.

Where the caller keeps going (the chat app, the server), `begin_upgrade` loads the fast model in
a thread once the helper is done, and the caller swaps it in between replies. Replies before the
swap are the exact path's: the same model, computed in float32, so the greedy text may differ in
the last bits from the fast kernels' (as `--cpu-kernels exact` does).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import torch

from ..cache import ram_size
from ..cache.device_memory import device_free_bytes
from ..gguf.reader import GGUFFile
from ..nn.eager import eager_only
from . import compile_ahead

logger = logging.getLogger(__name__)

MEMORY_SHARE = 0.25  # of the host's available RAM, at most, for the float32 copies the exact path keeps


def float_bytes(gguf: GGUFFile) -> tuple[int, int]:
    """Bytes of the model's weights in float32: (dense, experts)."""
    experts = set(ram_size.expert_tensors(gguf))
    dense = sum(4 * t.n_elements for n, t in gguf.tensors.items() if n not in experts)
    return dense, sum(4 * gguf.tensors[n].n_elements for n in experts)


def dequant_budget_mib(gguf: GGUFFile) -> float | None:
    """MiB of dequantized experts the exact path may keep (None: its dense float32 copies alone do not fit
    in its share of RAM, and the first start compiles before it answers, as before)."""
    dense, experts = float_bytes(gguf)
    share = MEMORY_SHARE * device_free_bytes(torch.device("cpu"))
    if dense > share:
        return None
    return min(experts, share - dense) / 2**20


class EagerModel:
    """A model whose forward runs torch's ops only (nn.eager): what generation calls during a first start."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, tokens: torch.Tensor, pos0: int, cache: Any, last_only: bool = False) -> torch.Tensor:
        with eager_only():
            return self.model(tokens, pos0, cache, last_only)


class Closable(Protocol):
    def close(self) -> None: ...


M = TypeVar("M", bound=Closable)


class FirstStart(Generic[M]):
    """The kernels a first start compiles in its helper, and the fast model (a loader.LoadedModel) once they are."""

    def __init__(self, helper: subprocess.Popen[bytes] | None, model_kind: str, load_fast: Callable[[], M],
                 threads: int) -> None:  # fmt: skip
        """`helper`: this start's, or None where another start's compiles the kind (behind its lock);
        `threads`: torch's threads to give back when the fast model takes over."""
        self.helper = helper
        self.model_kind = model_kind
        self.threads = threads
        self._load_fast = load_fast
        self._thread: threading.Thread | None = None
        self._fast: M | None = None
        self._taken = False
        self.error: BaseException | None = None

    def compiling(self) -> bool:
        """Whether a helper still compiles the kernels."""
        if self.helper is not None and self.helper.poll() is None:
            return True
        return compile_ahead.compiling_elsewhere(self.model_kind)

    def begin_upgrade(self) -> None:
        """Load the fast model in a thread once the helper is through (the caller swaps it in with `take`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._upgrade, name="moechat-first-start", daemon=True)
            self._thread.start()

    def _upgrade(self) -> None:
        if self.helper is not None:
            self.helper.wait()
        with compile_ahead.compiling_lock(self.model_kind, wait=True):
            pass  # another start's helper, where that one compiles them
        try:
            self._fast = self._load_fast()  # what the helper did not compile compiles here, off the replies' path
        except Exception as e:  # the exact path keeps serving; the next start loads as usual
            logger.warning("the fast kernels did not load (%s): replies keep the exact path", e)
            self.error = e
        else:
            logger.info("first start: the fast kernels are compiled; they take over from the next reply")

    def ready(self) -> bool:
        """Whether the fast model is loaded (or failed to: the exact path then keeps serving)."""
        return self._thread is not None and not self._thread.is_alive()

    def take(self, wait: bool = False) -> M | None:
        """The fast model, once loaded (once only: the caller owns it then); `wait`: until then."""
        if wait:
            self.begin_upgrade()
            if self._thread is not None:
                self._thread.join()
        if self._fast is None or self._taken:
            return None
        self._taken = True
        torch.set_num_threads(self.threads)  # no helper beside it now
        return self._fast

    def close(self) -> None:
        """The helper keeps compiling for the next start; a fast model loaded but never taken is closed."""
        if self._thread is not None and not self._thread.is_alive() and self._fast is not None and not self._taken:
            self._fast.close()
        if self.compiling():
            logger.info("kernels keep compiling in the background for the next start")
