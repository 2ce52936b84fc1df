"""The opt-in int4 CPU kernel path (--cpu-kernels int4): exact codes, bounded error, same cache invariance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from moechat.engine.expert_cache import CacheSettings
from moechat.engine.fast_kernels import Int4Linear
from moechat.engine.loader import load_model
from moechat.engine.quants import dequantize, int4_groups
from testkit.ggufgen import Q, random_blocks, tiny_moe


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K])
def test_int4_codes_are_exact_and_the_kernel_error_is_bf16_sized(qtype: Q) -> None:
    rng = np.random.default_rng(1)
    block, size = GGML_QUANT_SIZES[qtype]
    n, k = 256, 1024
    raw = torch.from_numpy(random_blocks(qtype, n * k // block, rng).reshape(n, k // block * size))
    w = dequantize(raw, qtype)
    q, scale, minv = int4_groups(raw, qtype)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    assert torch.equal(scale.repeat_interleave(32, 1) * q.float() - minv.repeat_interleave(32, 1), w)
    x = torch.randn(5, k)
    ref = x @ w.T
    got = Int4Linear(raw, qtype)(x)
    # bf16 activations and scales: about 3 significant digits.
    assert float((got - ref).norm() / ref.norm()) < 0.01


def test_int4_path_keeps_the_cache_invariance_and_stays_close(tmp_path: Path) -> None:
    path = tiny_moe(tmp_path / "m.gguf", n_layers=2, n_expert=8, n_expert_used=2, expert_type=Q.Q4_K, logit_scale=4.0)
    ids = torch.tensor(load_model(path, n_ctx=64).tokenizer.encode("The river rose in the spring and")[:12])

    def logits(**kw: object) -> torch.Tensor:
        lm = load_model(path, n_ctx=64, **kw)
        kv = lm.new_cache()
        with torch.inference_mode():
            return torch.cat([lm.model(ids[i : i + 1], i, kv) for i in range(len(ids))])

    exact = logits()
    fast = logits(cpu_kernels="int4")
    cached = logits(cpu_kernels="int4", cache=CacheSettings(mib=0.5, cpu_share=0.5))
    assert torch.equal(fast, cached)  # on the CPU device the cache still changes nothing
    assert not torch.equal(fast, exact)  # the fast path did run
    assert float((fast - exact).norm() / exact.norm()) < 0.02
    assert float((fast.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.9
    with pytest.raises(ValueError, match="cpu-kernels"):
        load_model(path, n_ctx=64, cpu_kernels="int2")
