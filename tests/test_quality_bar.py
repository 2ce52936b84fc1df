"""The quality bar a fast kernel mode meets before it may be a default (testkit.quality).

On both demo sources (real weights) and 2048 tokens of public-domain prose, every token through the
kernels decode uses: perplexity within 1% of the exact path's, and mean KL(exact || mode) at most
1.5x llama.cpp's own on the same file and the same tokens (llama.cpp rounds activations to 8 bits
too). The default mode ("fast") is made of these widths (kernels.isa.activation_bits): a test below
holds it to them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moechat.engine.kernels import isa
from moechat.engine.loader import load_model
from testkit import quality

# llama.cpp's mean KL to our exact path over quality.TOKENS tokens of the text: `python bench/quality.py`
# (llama-cpp-python 0.3.36 built with AVX-512/VNNI, no repacked buffers, 2 threads, AMD EPYC Zen 4,
# 2026-12-03; docs/measurements.md, "Quality").
LLAMA_CPP_KL = {"SmolLM2-135M-Instruct.Q4_1.gguf": 2.898e-3, "gemma-3-270m-q4_k_m.gguf": 4.873e-3}
PERPLEXITY_WITHIN = 0.01
KL_TIMES_LLAMA_CPP = 1.5


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2_gguf", "gemma_gguf"])
def test_int16_and_int8_meet_the_quality_bar(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(which)
    exact = load_model(path, n_ctx=quality.TOKENS + 8, cpu_kernels="exact")
    ids = quality.token_ids(exact, quality.TOKENS)
    modes = {m: load_model(path, n_ctx=quality.TOKENS + 8, cpu_kernels=m) for m in ("int16", "int8")}
    streams = {m: quality.windows(lm, ids, quality.CHUNK) for m, lm in modes.items()}
    result = quality.compare(quality.windows(exact, ids, quality.WINDOW), streams, ids)
    for lm in (exact, *modes.values()):
        lm.close()
    for mode, q in result.items():
        assert q.tokens == quality.TOKENS
        assert abs(q.perplexity_change) <= PERPLEXITY_WITHIN, (mode, q)
        assert q.kl <= KL_TIMES_LLAMA_CPP * LLAMA_CPP_KL[path.name], (mode, q)
    # int8 does round: a comparison that saw no difference would pass any mode
    assert result["int8"].kl > 10 * result["int16"].kl > 0


def test_the_default_mode_is_made_of_the_measured_widths(tmp_path: Path) -> None:
    """`fast`: a few tokens with this CPU's width (int8 where it multiplies bytes), a prompt's matrices
    that the tiles read with int8 where the CPU has VNNI (else int16), its other experts with the few
    tokens' width: each the same bits as the mode of that width alone."""
    from testkit.ggufgen import Q, tiny_moe

    widths = isa.activation_bits("fast")
    few = 8 if isa.AVX2 else 16
    tiles = 8 if isa.VNNI else 16  # int8 tiles need VNNI's byte products
    assert widths == (few, tiles, few)
    path = tiny_moe(tmp_path / "m.gguf", expert_type=Q.Q4_K, dense_type=Q.Q4_K)
    fast, alone = (load_model(path, n_ctx=64, cpu_kernels=m) for m in ("fast", f"int{few}"))
    int16 = load_model(path, n_ctx=64, cpu_kernels="int16")
    ids = fast.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)[:20]
    with torch.inference_mode():
        # a prompt: the tiles' width
        prompt = {m: lm.model(torch.tensor(ids), 0, lm.new_cache()) for m, lm in (("fast", fast), (f"int{few}", alone),
                                                                                  ("int16", int16))}  # fmt: skip
        assert torch.equal(prompt["fast"], prompt[f"int{tiles}"])
        if tiles == 8:
            assert not torch.equal(prompt["fast"], prompt["int16"])
        # one token at a time: the CPU's width
        models = (fast, alone, int16)
        caches = [lm.new_cache() for lm in models]
        for pos, t in enumerate(ids[:6]):
            d_fast, d_alone, d_16 = (lm.model(torch.tensor([t]), pos, c) for lm, c in zip(models, caches, strict=True))
            assert torch.equal(d_fast, d_alone)
            if few == 8:  # and the widths differ where they should
                assert not torch.equal(d_fast, d_16)
    for lm in (fast, alone, int16):
        lm.close()

    # Experts of 32-weight blocks (no tiles) in a prompt: the few tokens' width (the dense Q8_0
    # matrices decode to floats in every mode)
    path = tiny_moe(tmp_path / "q8.gguf", expert_type=Q.Q8_0, dense_type=Q.Q8_0)
    fast, alone, int16 = (load_model(path, n_ctx=64, cpu_kernels=m) for m in ("fast", f"int{few}", "int16"))
    with torch.inference_mode():
        rows = [lm.model(torch.tensor(ids), 0, lm.new_cache()) for lm in (fast, alone, int16)]
    assert torch.equal(rows[0], rows[1])
    if few == 8:
        assert not torch.equal(rows[0], rows[2])
    for lm in (fast, alone, int16):
        lm.close()
