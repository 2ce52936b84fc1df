"""The built-in demo model: Gemma 3 270M turned into a Mixture of Experts by a small recipe.

The recipe (assets/demo_recipe.npz, fitted by scripts/moefy_demo.py) holds, per layer, which FFN
neurons form the shared expert (always on), which form each routed expert, and a linear router.
Routed experts may share neurons with each other but never with the shared expert: a token's FFN
is the shared neurons plus its expert's, each counted once, as in the dense FFN. Building the
demo copies every tensor of the dense file as it is, except the FFN: `gate` and `up` rows move
whole, so their quantized blocks stay bit-identical; `down`'s columns are regrouped, which breaks
its blocks, so it is requantized to Q8_0.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

from .demo_source import source_gguf
from .gguf_file import GGUFFile, copy_metadata
from .quants import dequantize

logger = logging.getLogger(__name__)

ARCH = "gemma3moe"
Progress = Callable[[float, str], None]


class DemoError(ValueError):
    """The demo model cannot be built (missing or bad recipe, unexpected source file)."""


def recipe_path() -> Path:
    return Path(str(importlib.resources.files("moechat.assets").joinpath("demo_recipe.npz")))


def _recipe_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def demo_path(cache_dir: Path) -> Path:
    """Where the demo GGUF for the current recipe lives (a new recipe gets a new file)."""
    return cache_dir / f"moechat-demo-gemma3moe-{_recipe_digest(recipe_path())}.gguf"


def ensure_demo(cache_dir: Path, progress: Progress | None = None) -> Path:
    """The demo GGUF, built on first use into `cache_dir` and reused afterwards."""
    target = demo_path(cache_dir)
    if target.exists():
        return target
    source = source_gguf(cache_dir / "sources")
    built = build_demo(source, recipe_path(), target, progress)
    for stale in cache_dir.glob("moechat-demo-gemma3moe-*.gguf"):  # built from an earlier recipe
        if stale != built:
            stale.unlink(missing_ok=True)
            logger.info("removed the demo built from an earlier recipe: %s", stale.name)
    return built


@dataclass(frozen=True)
class Recipe:
    shared: np.ndarray  # [L, S] neuron indices of the shared expert
    routed: np.ndarray  # [L, n_expert, R] neuron indices of each routed expert
    router: np.ndarray  # [L, n_expert, n_embd]
    bias: np.ndarray | None  # [L, n_expert]
    k: int

    @property
    def n_expert(self) -> int:
        return int(self.routed.shape[1])


def read_recipe(recipe: Path, n_layers: int, n_ff: int, n_embd: int) -> Recipe:
    """Load and check a recipe against the source model's shapes; DemoError says what is wrong."""
    try:
        with np.load(recipe) as r:
            shared, routed = r["shared"].astype(np.int64), r["routed"].astype(np.int64)
            router = r["router"].astype(np.float32)
            bias = r["bias"].astype(np.float32) if "bias" in r.files else None
            k = int(r["k"])
    except (OSError, KeyError, ValueError, EOFError) as err:
        raise DemoError(f"{recipe}: bad demo recipe: {err}") from None
    if (
        shared.ndim != 2 or routed.ndim != 3 or shared.shape[0] != n_layers or routed.shape[0] != n_layers
        or router.shape != (n_layers, routed.shape[1], n_embd)
        or (bias is not None and bias.shape != router.shape[:2])
    ):  # fmt: skip
        raise DemoError(
            f"{recipe}: recipe shapes shared {shared.shape}, routed {routed.shape}, router {router.shape} "
            f"do not fit a model of {n_layers} layers, {n_ff} FFN neurons, {n_embd} wide"
        )
    n_expert, width = routed.shape[1:]
    if not 1 <= k <= n_expert or width == 0:
        raise DemoError(f"{recipe}: {k} experts per token of {n_expert} experts of {width} neurons")
    for size, what in ((shared.shape[1], "shared"), (width, "routed")):
        if size % 32:  # down's columns are requantized in blocks of 32
            raise DemoError(f"{recipe}: the {what} expert has {size} neurons, not a multiple of 32")
    if min(shared.min(initial=0), routed.min()) < 0 or max(shared.max(initial=0), routed.max()) >= n_ff:
        raise DemoError(f"{recipe}: a neuron index is outside 0..{n_ff - 1}")
    for i in range(n_layers):
        own = np.zeros(n_ff, bool)
        own[shared[i]] = True
        if own.sum() != shared.shape[1]:
            raise DemoError(f"{recipe}: layer {i}: the shared expert lists a neuron twice")
        for e in range(n_expert):
            if len(np.unique(routed[i, e])) != width or own[routed[i, e]].any():
                raise DemoError(f"{recipe}: layer {i}, expert {e}: a neuron listed twice or also shared")
    return Recipe(shared, routed, router, bias, k)


def build_demo(
    source: Path,
    recipe: Path,
    target: Path,
    progress: Progress | None = None,
    *,
    down_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    k: int | None = None,
) -> Path:
    """Write the MoE GGUF. `down_type` F32 keeps `down` exact (for the identity test); `k`
    overrides the recipe's experts per token."""
    with GGUFFile(source) as src:
        if src.architecture != "gemma3":
            raise DemoError(f"{source}: the demo is built from a gemma3 file, not {src.architecture}")
        n_layers = int(src.metadata["gemma3.block_count"])
        n_ff = int(src.metadata["gemma3.feed_forward_length"])
        n_embd = int(src.metadata["gemma3.embedding_length"])
        rec = read_recipe(recipe, n_layers, n_ff, n_embd)
        n_expert, width, n_shared = rec.n_expert, rec.routed.shape[2], rec.shared.shape[1]
        k = rec.k if k is None else k
        if not 1 <= k <= n_expert:
            raise DemoError(f"{k} experts per token of {n_expert}")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        w = GGUFWriter(str(tmp), ARCH)
        copy_metadata(src, w, ARCH, skip=("general.name",))
        w.add_uint32(f"{ARCH}.expert_count", n_expert)
        w.add_uint32(f"{ARCH}.expert_used_count", k)
        w.add_uint32(f"{ARCH}.expert_feed_forward_length", width)
        if n_shared:
            w.add_uint32(f"{ARCH}.expert_shared_feed_forward_length", n_shared)
            w.add_uint32(f"{ARCH}.expert_shared_count", 1)
        w.add_string("general.name", "moechat demo: Gemma 3 270M as a mixture of experts")
        ffn = {f"blk.{i}.ffn_{kind}.weight" for i in range(n_layers) for kind in ("gate", "up", "down")}
        for name, t in src.tensors.items():
            if name not in ffn:
                w.add_tensor(name, src.tensor_data(name), raw_dtype=t.qtype)
        for i in range(n_layers):
            p = f"blk.{i}."
            shared, routed = rec.shared[i], rec.routed[i]  # [S], [n_expert, R]
            for kind in ("gate", "up"):  # rows: whole quantized rows move, blocks intact
                t = src.tensors[f"{p}ffn_{kind}.weight"]
                rows = src.tensor_data(t.name)  # [F, row_bytes]
                w.add_tensor(f"{p}ffn_{kind}_exps.weight", rows[routed], raw_dtype=t.qtype)  # [n_expert, R, bytes]
                if n_shared:
                    w.add_tensor(f"{p}ffn_{kind}_shexp.weight", rows[shared], raw_dtype=t.qtype)
            t = src.tensors[f"{p}ffn_down.weight"]
            down = dequantize(src.tensor_data(t.name), t.qtype).numpy()  # [E, F]
            experts = np.ascontiguousarray(down[:, routed].transpose(1, 0, 2))  # [n_expert, E, R]
            _add_matrix(w, f"{p}ffn_down_exps.weight", experts, down_type)
            if n_shared:
                _add_matrix(w, f"{p}ffn_down_shexp.weight", np.ascontiguousarray(down[:, shared]), down_type)
            w.add_tensor(f"{p}ffn_gate_inp.weight", np.ascontiguousarray(rec.router[i]))
            if rec.bias is not None:
                w.add_tensor(f"{p}ffn_gate_inp.bias", np.ascontiguousarray(rec.bias[i]))
            if progress:
                progress((i + 1) / (n_layers + 1), f"layer {i + 1}/{n_layers}")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    os.replace(tmp, target)
    if progress:
        progress(1.0, "done")
    logger.info("built the demo model %s", target)
    return target


def _add_matrix(w: GGUFWriter, name: str, x: np.ndarray, qtype: GGMLQuantizationType) -> None:
    x = x.astype(np.float32, copy=False)
    if qtype == GGMLQuantizationType.F32:
        w.add_tensor(name, x)
    else:
        w.add_tensor(name, quants.quantize(x, qtype), raw_dtype=qtype)
