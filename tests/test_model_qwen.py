"""Qwen MoE models end to end, against transformers with the same weights (fp32)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moechat.engine.generate import GREEDY, DoneEvent, TokenEvent, generate
from moechat.engine.loader import LoadedModel, load_model
from testkit.ggufgen import Q, tiny_moe
from testkit.hf_ref import qwen3moe_reference

PROMPT = "The history of the city begins with a small fishing village on the river, where traders met"


@pytest.fixture(scope="module", params=[Q.F32, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def qwen3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tiny_moe(tmp_path_factory.mktemp("q3") / f"qwen3moe-{request.param.name}.gguf", expert_type=request.param)
    return load_model(path, n_ctx=256)


def test_logits_match_transformers(qwen3: LoadedModel) -> None:
    ids = qwen3.tokenizer.encode(PROMPT)[:32]
    assert len(ids) == 32 or len(ids) >= 16
    cache = qwen3.new_cache()
    with torch.inference_mode():
        ours = qwen3.model(torch.tensor(ids), 0, cache)
        ref = qwen3moe_reference(qwen3.gguf, qwen3.config)(torch.tensor([ids])).logits[0]
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-4, rel


def test_incremental_decode_equals_one_batch(qwen3: LoadedModel) -> None:
    ids = qwen3.tokenizer.encode(PROMPT)[:20]
    with torch.inference_mode():
        full = qwen3.model(torch.tensor(ids), 0, qwen3.new_cache())
        cache = qwen3.new_cache()
        first = qwen3.model(torch.tensor(ids[:12]), 0, cache)
        steps = [qwen3.model(torch.tensor([t]), cache.pos, cache) for t in ids[12:]]
    inc = torch.cat([first, *steps])
    assert torch.allclose(inc, full, atol=1e-5, rtol=1e-4)


def test_greedy_continuation_matches_transformers(qwen3: LoadedModel) -> None:
    prompt = qwen3.tokenizer.encode(PROMPT)
    events = list(generate(qwen3.model, qwen3.tokenizer, prompt, qwen3.new_cache(), max_tokens=32,
                           params=GREEDY, ignore_eos=True))  # fmt: skip
    ours = [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.n_generated == 32 and done.stop_reason == "length"
    hf = qwen3moe_reference(qwen3.gguf, qwen3.config)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert ours == out[0, len(prompt) :].tolist()


def test_cli_run(tmp_path: Path) -> None:
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=512)
    base = [sys.executable, "-m", "moechat", "run", str(model), "-p", "Hello there", "-n", "12", "--ignore-eos"]
    a = subprocess.run([*base, "--seed", "7"], capture_output=True, text=True, timeout=120)
    b = subprocess.run([*base, "--seed", "7"], capture_output=True, text=True, timeout=120)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip()
    assert "generation: 12 tokens" in a.stderr and "prompt:" in a.stderr and "t/s" in a.stderr
    cmd = [sys.executable, "-m", "moechat", "run", str(model), "-p", "word " * 400, "-c", "64"]
    long = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert long.returncode == 2 and "Traceback" not in long.stderr
    assert "the context holds 64" in long.stderr.strip().splitlines()[-1]
