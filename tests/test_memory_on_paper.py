"""docs/design.md's memory figures: `moechat inspect` on files with the real geometries agrees with the formulas.

The files hold a few layers of Qwen3.5-35B-A3B, GLM-4.5-Air and DeepSeek-V3 with every tensor at
its real shape and type; the tensor data is left sparse (a hole in the file), since inspect reads
only the header. The closed forms in bench/memory_on_paper.py give the figures to agree with.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter
from moechat.app.inspect_cmd import summary_rows
from moechat.engine.models.opening import open_model


def _paper() -> ModuleType:
    path = Path(__file__).parent.parent / "bench" / "memory_on_paper.py"
    spec = importlib.util.spec_from_file_location("memory_on_paper", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


paper = _paper()


def _metadata(g: Any) -> dict[str, Any]:
    a = g.arch
    meta: dict[str, Any] = {
        f"{a}.block_count": g.n_layers, f"{a}.context_length": g.ctx_train, f"{a}.embedding_length": g.n_embd,
        f"{a}.attention.head_count": g.n_head, f"{a}.attention.head_count_kv": g.n_kv,
        f"{a}.attention.key_length": g.head_dim, f"{a}.attention.value_length": g.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.expert_count": g.experts,
        f"{a}.expert_used_count": g.used, f"{a}.expert_feed_forward_length": g.ff_exp,
        f"{a}.expert_shared_feed_forward_length": g.shared_ff, f"{a}.rope.dimension_count": g.head_dim // 2,
    }  # fmt: skip
    if g.dense_lead:
        meta |= {f"{a}.leading_dense_block_count": g.dense_lead, f"{a}.feed_forward_length": g.dense_ff,
                 f"{a}.expert_shared_count": 1}  # fmt: skip
    if g.full_every:
        hk, hv, dk, dv, taps = g.linear
        meta |= {f"{a}.full_attention_interval": g.full_every, f"{a}.ssm.conv_kernel": taps,
                 f"{a}.ssm.state_size": dk, f"{a}.ssm.group_count": hk, f"{a}.ssm.time_step_rank": hv,
                 f"{a}.ssm.inner_size": hv * dv, f"{a}.rope.dimension_count": g.head_dim // 4}  # fmt: skip
    if g.mla[1]:
        q_rank, c, nope, rope, v = g.mla
        meta |= {f"{a}.attention.q_lora_rank": q_rank, f"{a}.attention.kv_lora_rank": c,
                 f"{a}.attention.key_length": c + rope, f"{a}.attention.value_length": c,
                 f"{a}.attention.key_length_mla": nope + rope, f"{a}.attention.value_length_mla": v,
                 f"{a}.rope.dimension_count": rope, f"{a}.expert_group_count": 8,
                 f"{a}.expert_group_used_count": 4, f"{a}.expert_gating_func": 2}  # fmt: skip
    return meta


def _sparse_gguf(path: Path, g: Any) -> Path:
    """A GGUF of geometry g: real header, tensor data a hole of the right size."""
    w = GGUFWriter(str(path), g.arch)
    for key, value in _metadata(g).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    tensors = [paper.typed(g, i, *t) for i in range(g.n_layers) for t in paper.layer_tensors(g, i)]
    tensors += [paper.typed(g, 0, *t) for t in paper.end_tensors(g)]
    total = 0
    for name, shape, qtype in tensors:
        n = paper.nbytes(shape, qtype)
        w.add_tensor_info(name, shape, np.dtype(np.float32), n, raw_dtype=qtype)
        total += -(-n // 32) * 32  # each tensor's data starts aligned
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    if w.fout is None:
        raise RuntimeError("the writer has no open file after writing its header")
    f = w.fout[0]
    f.flush()
    f.truncate(-(-f.tell() // 32) * 32 + total)
    w.close()
    return path


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@pytest.mark.parametrize("name", [g.name for g in paper.MODELS])
def test_inspect_agrees_with_the_memory_formulas(tmp_path: Path, name: str) -> None:
    g = next(m for m in paper.MODELS if m.name == name)
    # A few layers: the dense lead ones, one or more MoE layers, full and linear attention, two
    # expert types (llama.cpp's "more bits" rule over this layer count).
    few = dataclasses.replace(g, n_layers=max(g.dense_lead + 2, 4), nextn=0)
    path = _sparse_gguf(tmp_path / "m.gguf", few)
    assert path.stat().st_size > 10**9  # the real sizes, on paper: gigabytes of (sparse) experts
    gguf, cfg = open_model(path)
    with gguf:
        rows = dict(summary_rows(gguf, cfg))
    moe = range(few.dense_lead, few.n_layers)
    per_layer = sorted({paper.expert_layer_bytes(few, i) for i in moe})
    assert len(per_layer) == (2 if few.mix == "Q4_K_M" else 1)  # Q4_K_M: two down-projection types appear
    span = _mib(per_layer[0]) + (f" to {_mib(per_layer[-1])}" if len(per_layer) > 1 else "") + " per MoE layer"
    total = sum(paper.expert_layer_bytes(few, i) for i in moe)
    assert rows["expert bytes"] == f"{_mib(total)} total, {span}, {_mib(per_layer[-1] // few.experts)} per expert"
    kv = paper.kv_bytes_per_token(few)
    assert rows["KV cache (float32)"].startswith(f"{kv / 2**10:,.1f} KiB per token")
    assert rows["KV cache (float32)"].endswith(f"{_mib(kv * few.ctx_train)} at {few.ctx_train} tokens")
    if few.full_every:
        assert rows["linear attention state"].startswith(f"{_mib(paper.linear_state_bytes(few))} at any context")
    linear = sum(few.is_linear(i) for i in range(few.n_layers))
    kinds = "latent attention" if few.mla[1] else "full attention"
    assert rows["layers"].startswith(f"{few.n_layers}: {few.n_layers - linear} {kinds}")
    assert f"{few.dense_lead} dense FFN, {len(moe)} MoE" in rows["layers"]
