"""A model is built from its config and tensor layout, then loaded: the build reads no tensor bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from moechat.engine.loader import load_model
from moechat.engine.models import build_model, config_for
from moechat.engine.models.decoder import MoeFFN
from moechat.engine.nn.layers import KVCache
from moechat.engine.nn.weights import load_weights, pending
from testkit.ggufgen import ARCHS, MemoryModel, tiny_moe_parts, write_gguf


class CountingModel(MemoryModel):
    """Counts the tensors whose bytes are read."""

    reads = 0

    def tensor_data(self, name: str) -> np.ndarray:
        self.reads += 1
        return super().tensor_data(name)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_builds_without_its_bytes_and_loads_to_what_the_file_gives(arch: str, tmp_path: Path) -> None:
    parts = tiny_moe_parts(arch=arch, n_layers=2, dense_layers=1 if arch == "deepseek2" else 0)
    mem = CountingModel(*parts[:3])
    cfg = config_for(mem)
    model = build_model(mem, cfg, 64, quantized=True)
    # Built: the structure is there, every weight waits, and not one tensor's bytes were read.
    assert mem.reads == 0
    waiting = set(pending(model))
    assert "token_embd.weight" in waiting and "output_norm.weight" in waiting
    assert all(name in mem.tensors for name in waiting)
    routers = [i for i in range(cfg.n_layers) if f"blk.{i}.ffn_gate_inp.weight" in mem.tensors]
    assert [i for i, b in enumerate(model.blocks) if isinstance(b.ffn, MoeFFN)] == routers == model.moe_layers
    assert not model.host_experts.layers  # the experts are read at load
    # Loaded from memory: nothing waits, and the logits are those of the same tensors read from a file.
    load_weights(model, mem)
    assert pending(model) == [] and mem.reads > 0
    assert sorted(model.host_experts.layers) == routers
    arch_, meta, tensors, vocab = parts
    lm = load_model(write_gguf(tmp_path / "m.gguf", arch_, meta, tensors, vocab=vocab), n_ctx=64)
    tokens = torch.tensor([1, 5, 9, 2])
    with torch.inference_mode():
        want = lm.model(tokens, 0, KVCache(cfg, 64))
        got = model(tokens, 0, KVCache(cfg, 64))
    lm.close()
    assert torch.equal(got, want)


def test_a_tied_embedding_is_read_once_and_shared() -> None:
    mem = CountingModel(*tiny_moe_parts(tied=True, n_layers=1)[:3])
    model = build_model(mem, config_for(mem), 64, quantized=False)
    load_weights(model, mem)
    assert model.embed is model.output


def test_a_missing_tensor_is_named_at_build_time() -> None:
    from moechat.engine.gguf.reader import GGUFError

    arch, meta, tensors, _ = tiny_moe_parts(n_layers=1)
    del tensors["blk.0.attn_k.weight"]
    mem = MemoryModel(arch, meta, tensors)
    with pytest.raises(GGUFError, match=r"<memory>: tensor 'blk.0.attn_k.weight' is missing"):
        build_model(mem, config_for(mem), 64)
