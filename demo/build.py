"""The built-in demos: small dense chat models turned into Mixtures of Experts by a recipe.

Two demos: `smollm2` (the default; SmolLM2-135M-Instruct, a llama, so the built file is a llama
with experts and a shared expert) and `gemma` (Gemma 3 270M, a base model that does not chat;
built as `gemma3moe`). A recipe (assets/demo_recipe*.npz, fitted by scripts/moefy_demo.py)
holds, per layer, which FFN neurons form the shared expert (always on), which form each routed
expert, and a linear router. Routed experts may share neurons with each other but never with the
shared expert: a token's FFN is the shared neurons plus its expert's, each counted once, as in
the dense FFN. Building the demo copies every tensor of the dense file as it is, except the FFN:
`gate` and `up` rows move whole, so their quantized blocks stay bit-identical; `down`'s columns
are regrouped, which breaks its blocks, so it is requantized to Q8_0.
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
from moechat.engine.gguf.dequant import dequantize
from moechat.engine.gguf.reader import GGUFFile, copy_metadata

from .source import gemma_gguf, smollm2_gguf

logger = logging.getLogger(__name__)

Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class DemoSpec:
    name: str
    title: str  # general.name of the built file
    source: Callable[[Path], Path]  # cache folder -> the dense source GGUF
    source_arch: str
    arch: str  # of the built file
    recipe: str  # file name in moechat.assets
    act: str  # the FFN's gating activation ("silu" or "gelu_tanh"), for fitting recipes


DEMOS = {
    "smollm2": DemoSpec("smollm2", "moechat demo: SmolLM2-135M-Instruct as a mixture of experts", smollm2_gguf,
                        "llama", "llama", "demo_recipe_smollm2.npz", "silu"),
    "gemma": DemoSpec("gemma", "moechat demo: Gemma 3 270M as a mixture of experts", gemma_gguf,
                      "gemma3", "gemma3moe", "demo_recipe.npz", "gelu_tanh"),
}  # fmt: skip
DEFAULT_DEMO = "smollm2"


class DemoError(ValueError):
    """The demo model cannot be built (missing or bad recipe, unexpected source file)."""


def demo_spec(name: str) -> DemoSpec:
    if name not in DEMOS:
        raise DemoError(f"no demo named '{name}' (demos: {', '.join(DEMOS)})")
    return DEMOS[name]


def recipe_path(name: str = DEFAULT_DEMO) -> Path:
    return Path(str(importlib.resources.files("moechat.assets").joinpath(demo_spec(name).recipe)))


def _recipe_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def demo_path(cache_dir: Path, name: str = DEFAULT_DEMO) -> Path:
    """Where a demo's GGUF for its current recipe lives (a new recipe gets a new file)."""
    return cache_dir / f"moechat-demo-{name}-{_recipe_digest(recipe_path(name))}.gguf"


def ensure_demo(cache_dir: Path, progress: Progress | None = None, name: str = DEFAULT_DEMO) -> Path:
    """A demo's GGUF, built on first use into `cache_dir` and reused afterwards."""
    spec = demo_spec(name)
    target = demo_path(cache_dir, name)
    if target.exists():
        return target
    if progress:
        progress(0.0, "getting the source model (first use only; it may be a download)")
    source = spec.source(cache_dir / "sources")
    built = build_demo(source, recipe_path(name), target, progress, spec=spec)
    # Built from an earlier recipe, or under the name the Gemma demo had before there were two.
    for stale in [*cache_dir.glob(f"moechat-demo-{name}-*.gguf"), *cache_dir.glob("moechat-demo-gemma3moe-*.gguf")]:
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
    spec: DemoSpec | None = None,
    down_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    k: int | None = None,
) -> Path:
    """Write the MoE GGUF. `down_type` F32 keeps `down` exact (for the identity test); `k`
    overrides the recipe's experts per token; `spec` (default: the demo built from the source's
    architecture) names the built file's architecture and title."""
    with GGUFFile(source) as src:
        spec = spec or next((d for d in DEMOS.values() if d.source_arch == src.architecture), None)
        if spec is None or src.architecture != spec.source_arch:
            sources = " or ".join(d.source_arch for d in DEMOS.values()) if spec is None else spec.source_arch
            raise DemoError(f"{source}: a demo is built from a {sources} file, not {src.architecture}")
        arch, src_arch = spec.arch, spec.source_arch
        n_layers = int(src.metadata[f"{src_arch}.block_count"])
        n_ff = int(src.metadata[f"{src_arch}.feed_forward_length"])
        n_embd = int(src.metadata[f"{src_arch}.embedding_length"])
        rec = read_recipe(recipe, n_layers, n_ff, n_embd)
        n_expert, width, n_shared = rec.n_expert, rec.routed.shape[2], rec.shared.shape[1]
        k = rec.k if k is None else k
        if not 1 <= k <= n_expert:
            raise DemoError(f"{k} experts per token of {n_expert}")
        target.parent.mkdir(parents=True, exist_ok=True)
        # Two first starts at once (two terminals, or test workers) each write their own file; the last
        # rename wins with the same bytes.
        tmp = target.with_name(f"{target.name}.{os.getpid()}.partial")
        w = GGUFWriter(str(tmp), arch)
        copy_metadata(src, w, arch, skip=("general.name",))
        w.add_uint32(f"{arch}.expert_count", n_expert)
        w.add_uint32(f"{arch}.expert_used_count", k)
        w.add_uint32(f"{arch}.expert_feed_forward_length", width)
        if n_shared:
            w.add_uint32(f"{arch}.expert_shared_feed_forward_length", n_shared)
            w.add_uint32(f"{arch}.expert_shared_count", 1)
        w.add_string("general.name", spec.title)
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
