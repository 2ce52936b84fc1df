"""The built-in demo model: Gemma 3 270M turned into a Mixture of Experts by a small recipe.

The recipe (assets/demo_recipe.npz, fitted by scripts/moefy_demo.py) holds, per layer, the
order of the 2048 FFN neurons grouped into experts, and a linear router. Building the demo:
every tensor of the dense file is copied as it is, except the FFN, which becomes experts.
`gate` and `up` rows are permuted whole, so their quantized blocks stay bit-identical; `down`'s
columns are permuted, which breaks its blocks, so it is requantized to Q8_0.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

from .demo_source import source_gguf
from .gguf_file import GGUFFile
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
    return build_demo(source, recipe_path(), target, progress)


def build_demo(
    source: Path,
    recipe: Path,
    target: Path,
    progress: Progress | None = None,
    *,
    down_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    k: int | None = None,
) -> Path:
    """Write the MoE GGUF. `down_type` F32 keeps `down` exact (for the k = E identity test); `k`
    overrides the recipe's experts per token."""
    try:
        r = np.load(recipe)
        perm, router, bias = r["perm"].astype(np.int64), r["router"], r["bias"]
        n_expert = int(r["n_expert"])
        k = int(r["k"]) if k is None else k
    except (OSError, KeyError, ValueError) as e:
        raise DemoError(f"{recipe}: bad demo recipe: {e}") from None
    with GGUFFile(source) as src:
        if src.architecture != "gemma3":
            raise DemoError(f"{source}: the demo is built from a gemma3 file, not {src.architecture}")
        n_layers = int(src.metadata["gemma3.block_count"])
        n_ff = int(src.metadata["gemma3.feed_forward_length"])
        n_embd = int(src.metadata["gemma3.embedding_length"])
        if perm.shape != (n_layers, n_ff) or router.shape != (n_layers, n_expert, n_embd) or n_ff % n_expert:
            raise DemoError(f"{recipe}: recipe shapes {perm.shape}, {router.shape} do not fit {source.name}")
        width = n_ff // n_expert
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        w = GGUFWriter(str(tmp), ARCH)
        _copy_metadata(src, w)
        w.add_uint32(f"{ARCH}.expert_count", n_expert)
        w.add_uint32(f"{ARCH}.expert_used_count", k)
        w.add_uint32(f"{ARCH}.expert_feed_forward_length", width)
        w.add_string("general.name", "moechat demo: Gemma 3 270M as a mixture of experts")
        ffn = {f"blk.{i}.ffn_{kind}.weight" for i in range(n_layers) for kind in ("gate", "up", "down")}
        for name, t in src.tensors.items():
            if name not in ffn:
                w.add_tensor(name, src.tensor_data(name), raw_dtype=t.qtype)
        for i in range(n_layers):
            p = f"blk.{i}."
            order = perm[i]
            for kind in ("gate", "up"):  # rows: whole quantized rows move, blocks intact
                t = src.tensors[f"{p}ffn_{kind}.weight"]
                rows = src.tensor_data(t.name)[order]  # [F, row_bytes]
                w.add_tensor(f"{p}ffn_{kind}_exps.weight", rows.reshape(n_expert, width, -1), raw_dtype=t.qtype)
            t = src.tensors[f"{p}ffn_down.weight"]
            down = dequantize(src.tensor_data(t.name), t.qtype).numpy()[:, order]  # [E, F] in expert order
            experts = down.reshape(n_embd, n_expert, width).transpose(1, 0, 2)  # [n_expert, E, width]
            experts = np.ascontiguousarray(experts, dtype=np.float32)
            if down_type == GGMLQuantizationType.F32:
                w.add_tensor(f"{p}ffn_down_exps.weight", experts)
            else:
                w.add_tensor(f"{p}ffn_down_exps.weight", quants.quantize(experts, down_type), raw_dtype=down_type)
            w.add_tensor(f"{p}ffn_gate_inp.weight", np.ascontiguousarray(router[i], dtype=np.float32))
            w.add_tensor(f"{p}ffn_gate_inp.bias", np.ascontiguousarray(bias[i], dtype=np.float32))
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


_RENAMED = "gemma3."


def _copy_metadata(src: GGUFFile, w: GGUFWriter) -> None:
    for key, value in src.metadata.items():
        if key in ("general.architecture", "general.name") or key.startswith("split."):
            continue
        vtype, etype = src.value_types[key]
        name = ARCH + "." + key[len(_RENAMED) :] if key.startswith(_RENAMED) else key
        if vtype == GGUFValueType.ARRAY:
            sub = GGUFValueType(etype) if etype is not None else None
            w.add_key_value(name, list(value), GGUFValueType.ARRAY, sub_type=sub)
        else:
            w.add_key_value(name, value, GGUFValueType(vtype))
