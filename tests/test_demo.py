"""The built-in demo: the MoE built from Gemma 3 270M by a recipe is the dense model when all experts run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from moechat.engine.demo import DemoError, build_demo
from moechat.engine.gguf_file import GGUFFile
from moechat.engine.loader import load_model

PROMPT = "The lighthouse stood at the end of a long spit of sand, and for most of the year nobody went out to it"


def _random_recipe(path: Path, n_expert: int = 16, k: int = 4) -> Path:
    rng = np.random.default_rng(0)
    np.savez(
        path,
        perm=np.stack([rng.permutation(2048) for _ in range(18)]).astype(np.int16),
        router=rng.standard_normal((18, n_expert, 640)).astype(np.float32),
        bias=np.zeros((18, n_expert), np.float32),
        n_expert=np.int32(n_expert),
        k=np.int32(k),
    )
    return path


@pytest.fixture(scope="module")
def dense_logits(gemma_gguf: Path) -> tuple[list[int], torch.Tensor]:
    lm = load_model(gemma_gguf, n_ctx=64)
    ids = lm.tokenizer.encode(PROMPT)[:24]
    with torch.inference_mode():
        return ids, lm.model(torch.tensor(ids), 0, lm.new_cache())


def test_all_experts_reproduce_the_dense_model(
    gemma_gguf: Path, tmp_path: Path, dense_logits: tuple[list[int], torch.Tensor]
) -> None:
    recipe = _random_recipe(tmp_path / "r.npz")
    out = build_demo(gemma_gguf, recipe, tmp_path / "moe.gguf", down_type=Q.F32, k=16)
    lm = load_model(out, n_ctx=64)
    assert lm.config.arch == "gemma3moe" and lm.config.n_expert == 16 and lm.config.n_expert_used == 16
    ids, dense = dense_logits
    with torch.inference_mode():
        moe = lm.model(torch.tensor(ids), 0, lm.new_cache())
    assert float((moe - dense).abs().max() / dense.abs().max()) <= 1e-4


def test_the_build_keeps_everything_but_the_ffn_bit_identical(gemma_gguf: Path, tmp_path: Path) -> None:
    recipe = _random_recipe(tmp_path / "r.npz")
    steps: list[float] = []
    out = build_demo(gemma_gguf, recipe, tmp_path / "moe.gguf", progress=lambda f, _: steps.append(f))
    assert steps[-1] == 1.0 and steps == sorted(steps) and len(steps) >= 18
    perm = np.load(recipe)["perm"].astype(np.int64)
    with GGUFFile(gemma_gguf) as src, GGUFFile(out) as moe:
        assert moe.metadata["gemma3moe.block_count"] == 18 and moe.metadata["gemma3moe.expert_used_count"] == 4
        assert moe.metadata["tokenizer.ggml.tokens"] == src.metadata["tokenizer.ggml.tokens"]
        assert moe.value_types["gemma3moe.block_count"] == src.value_types["gemma3.block_count"]
        for name in ("token_embd.weight", "blk.3.attn_q.weight", "blk.17.post_ffw_norm.weight"):
            assert np.array_equal(moe.tensor_data(name), src.tensor_data(name))
        # gate rows move whole: expert e's rows are the dense rows perm[e*128:(e+1)*128], same bytes.
        gate = moe.tensor_data("blk.5.ffn_gate_exps.weight")
        assert gate.shape[:2] == (16, 128)
        assert np.array_equal(gate[2], src.tensor_data("blk.5.ffn_gate.weight")[perm[5][256:384]])
        assert moe["blk.5.ffn_down_exps.weight"].qtype == Q.Q8_0
    assert not list(tmp_path.glob("*.partial"))


def test_bad_recipe(gemma_gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    np.savez(bad, perm=np.zeros((3, 5), np.int16), router=np.zeros((3, 2, 640), np.float32),
             bias=np.zeros((3, 2), np.float32), n_expert=np.int32(2), k=np.int32(1))  # fmt: skip
    with pytest.raises(DemoError, match="do not fit"):
        build_demo(gemma_gguf, bad, tmp_path / "x.gguf")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DemoError, match="bad demo recipe"):
        build_demo(gemma_gguf, tmp_path / "junk.npz", tmp_path / "y.gguf")
