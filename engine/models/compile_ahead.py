"""A first start's kernels compiled on two cores: a helper process compiles from the far end of the forward.

numba compiles one kernel at a time per process, and a first start compiles dozens (the layer
halves alone take most of it). While `load_model` runs its first token through the model, which
compiles the kernels in the forward's order (attention first), a helper process loads the same
file and compiles from the other end: the dense FFN and shared-expert halves, the routing and the
output head with attention and experts skipped, then the experts and the expert cache's policy,
then attention. Both write numba's disk cache, and a kernel the helper has written is loaded, not
compiled, when the forward reaches it. They meet in the middle; whatever both compiled costs only
the helper's core. The helper starts only when this model's kernels were never compiled here
(a stamp per model kind in the kernel cache), only with a second core, and not with
MOECHAT_COMPILE_AHEAD=0 (the test suite's many small models would each start one).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    import fcntl
except ImportError:  # not POSIX: no lock, at worst two helpers compile the same kernels
    fcntl = None  # type: ignore[assignment]

from ..config import ModelConfig
from ..gguf.reader import GGUFFile

logger = logging.getLogger(__name__)


def kind(gguf: GGUFFile, cfg: ModelConfig, cpu_kernels: str) -> str:
    """What decides which kernels a model compiles: its architecture, its tensors' names (block numbers
    left out) and types, the kernel mode."""
    parts = sorted({f"{re.sub(r'[0-9]+', 'N', name)}:{t.qtype.name}" for name, t in gguf.tensors.items()})
    digest = hashlib.sha256("\n".join([cfg.arch, cpu_kernels, *parts]).encode()).hexdigest()
    return digest[:16]


def _stamp(model_kind: str) -> Path | None:
    cache = os.environ.get("NUMBA_CACHE_DIR")
    return Path(cache) / "models" / model_kind if cache else None


def _lock(model_kind: str) -> Path | None:
    stamp = _stamp(model_kind)
    return stamp.with_name(f"{model_kind}.compiling") if stamp is not None else None


@contextlib.contextmanager
def compiling_lock(model_kind: str, wait: bool) -> Iterator[bool]:
    """The lock a helper compiling alone holds while it runs (so that a second start beside it starts no
    second helper): yields whether it was taken; `wait`: until it is free."""
    path = _lock(model_kind)
    if path is None or fcntl is None:
        yield True
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compiling_elsewhere(model_kind: str) -> bool:
    """Whether a helper compiles this model kind alone now (another start's)."""
    with compiling_lock(model_kind, wait=False) as free:
        return not free


def compiled(model_kind: str) -> bool:
    """Whether a model of this kind has had its kernels compiled into this kernel cache."""
    stamp = _stamp(model_kind)
    return stamp is None or stamp.exists()


def mark_compiled(model_kind: str, n_compiled: int) -> None:
    """Stamp the model kind as compiled here, with the kernels its load compiled."""
    stamp = _stamp(model_kind)
    if stamp is not None:
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            if n_compiled or not stamp.exists():
                stamp.write_text(f"{n_compiled}\n")
        except OSError as e:  # a read-only cache: the next start compiles on one core again
            logger.debug("cannot write %s: %s", stamp, e)


def start(path: Path, n_ctx: int, cpu_kernels: str, model_kind: str,
          alone: bool = False) -> subprocess.Popen[bytes] | None:  # fmt: skip
    """The helper process for a model whose kernels were never compiled here, on a machine with a second core.
    `alone`: nothing compiles beside it (a first start answering from the exact path, engine.models.first_start):
    it runs every pass to the end, stamps the model kind compiled, and outlives its parent."""
    if os.environ.get("MOECHAT_COMPILE_AHEAD", "1") == "0" or compiled(model_kind) or (os.cpu_count() or 1) < 2:
        return None
    cmd = [sys.executable, "-m", __name__, str(path), str(n_ctx), cpu_kernels, *((model_kind,) if alone else ())]
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=alone)  # fmt: skip
    except OSError as e:
        logger.debug("no helper to compile ahead: %s", e)
        return None


def stop(helper: subprocess.Popen[bytes] | None) -> None:
    """The forward is through: what the helper still compiles is compiled already."""
    if helper is not None and helper.poll() is None:
        helper.kill()
        helper.wait()


class _NoExperts:
    """Experts that add nothing: the pass that compiles the attention's kernels alone."""

    prefetch_tokens = 0

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def token_call(self, layer: int) -> None:
        return None

    def account(self, layers: Any, ids: Any, ahead: Any = None) -> None:
        return None

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        return None


_no_experts = _NoExperts()


def compile_passes(path: Path, n_ctx: int, cpu_kernels: str) -> None:
    """The helper's work: the model built as `load_model` builds it on the CPU, then one token through it
    three times (attention and experts skipped, then attention skipped, then all), then the policy's."""
    from ..kernels.isa import activation_bits
    from ..nn.layers import KVCache
    from ..nn.weights import load_weights
    from . import build_model
    from .decode_plan import DecodePlan
    from .opening import open_model

    torch.set_num_threads(1)
    gguf, cfg = open_model(path)
    try:
        model = build_model(gguf, cfg, n_ctx, quantized=cpu_kernels != "exact", kernels=cpu_kernels)
        load_weights(model, gguf)
        widths = activation_bits(cpu_kernels)
        model.set_activation_bits(*widths)
        experts = model.experts
        with torch.inference_mode():
            for skip_attention, skip_experts in ((True, True), (True, False), (False, False)):
                model.experts = _no_experts if skip_experts else experts
                kv = KVCache(cfg, 1, device=model.device)
                plan = DecodePlan.build(model, (kv.device.type, kv.layers[0].k.dtype), attention=not skip_attention)
                model.head(plan.run(model.embed_tokens(torch.tensor([0])), 0, kv, 0, len(model.blocks)))
                if not skip_experts and skip_attention:
                    warm_prompt_kernels(model)
                    if cfg.is_moe:
                        warm_expert_kernels(model)
                        warm_policy()  # the loading process needs it last: before the attention it has begun with
    finally:
        gguf.close()


def warm_expert_kernels(model: Any) -> None:
    """The experts' general kernels (selection, gate/up, down, the sum by token), which a prompt and the
    expert cache run: a load's one decode token takes the one-call path (kernels.moe_token) instead.
    One call per distinct set of expert types, on one token with zero activations (and on a prompt's
    count where its activations' width differs)."""
    from ..kernels.codes import GEMM_TOKENS

    host = getattr(model, "host_experts", None)
    if host is None or not host.layers:
        return
    seen = set()
    k = model.cfg.n_expert_used
    for layer, lx in host.layers.items():
        kind = (lx.gate.qtype, lx.up.qtype, lx.down.qtype)
        if kind in seen or not host.fused[layer]:
            continue
        seen.add(kind)
        # A prompt's activations may be wider than a token's (kernels.isa.activation_bits): both kernels.
        for n in (1, GEMM_TOKENS) if host.bits_for(1, layer) != host.bits_for(GEMM_TOKENS, layer) else (1,):
            ids = torch.arange(k, dtype=torch.int64)[None].expand(n, k).contiguous()  # [n, k]
            host(layer, torch.zeros(n, model.cfg.n_embd), ids, torch.full((n, k), 1 / k))


def warm_prompt_kernels(model: Any) -> None:
    """The kernels a prompt's dense matrices run, which a load's one token does not (it takes the
    compiled layer halves): per distinct type and activations, the tiles' kernel (one row of zeros)
    or the float path's decoder."""
    import numpy as np

    from ..kernels import cpu as cpu_kernels
    from ..nn.qlinear import QLinear

    seen = set()
    for m in model.modules():
        for w in vars(m).values():
            if not isinstance(w, QLinear) or (w.qtype, w.prompt_bits, w.tiled) in seen:
                continue
            seen.add((w.qtype, w.prompt_bits, w.tiled))
            if w.tiled:
                cpu_kernels.dense(w.raw[:1], w.qtype, np.zeros((1, w.shape[1]), np.float32), w.prompt_bits)
            else:
                cpu_kernels.dequantize_rows(w.raw[:1], w.qtype, w.shape[1])


def warm_policy() -> None:
    """The expert cache's compiled lookup and prefetch, compiled (or loaded from the disk cache)."""
    from ..cache.policy import ClassLRU

    policy = ClassLRU([0, 1], 4, 2)
    policy.plan(0, [0, 1], 1)
    policy.plan(1, [2, 3], 1)
    policy.prefetch(0, [2], (1, [3]))
    policy.step_token(np.array([0, 1], np.int64), np.array([[0, 1], [2, 3]], np.int64), np.zeros(1, np.int32),
                      np.zeros((2, 3), np.int64))  # fmt: skip


if __name__ == "__main__":
    from ..kernels.jit import compile_notes

    alone = sys.argv[4] if len(sys.argv) > 4 else None
    with contextlib.ExitStack() as held:
        if alone is not None and not held.enter_context(compiling_lock(alone, wait=False)):
            sys.exit(0)  # another start's helper compiles this kind already
        try:
            with compile_notes(None) as counted:
                compile_passes(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
        except Exception:  # the helper only saves time: the loading process compiles whatever is missing
            sys.exit(1)
        if alone is not None:  # every pass is through: a start of this kind no longer needs a helper
            mark_compiled(alone, counted.started)
