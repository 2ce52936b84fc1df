"""The bench switch that replays recorded routing: the experts the executor sees are the trace's, mapped onto
the model's layers and ids, and only `moechat run` has the switch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from moechat.engine.cache.replay import ReplayedRouting, trace_tokens
from moechat.engine.events import GREEDY, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import load_model
from testkit.ggufgen import tiny_moe

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "real-routing" / "gemma.route.csv"


def _csv(path: Path, steps: list[dict[int, list[int]]], n_expert: int = 40) -> Path:
    """A route_trace v1 file: one token per step, its prompt recorded layer by layer as another engine did."""
    layers = sorted(steps[0])
    lines = ["# route_trace v1", f"# arch=x n_layer={len(layers)} n_expert={n_expert} n_expert_used=2"]
    lines += [f"# layer={la} expert_bytes=1000" for la in layers]
    lines.append("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes")
    for la in layers:  # layer-major, as a batched prompt is recorded
        for s, tok in enumerate(steps):
            lines += [f"0,0,{s},{la},{j},{e},0.5,0,0" for j, e in enumerate(tok[la])]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tokens_are_read_step_by_step_whatever_the_order_of_the_rows(tmp_path: Path) -> None:
    steps = [{0: [1, 2], 1: [3, 4]}, {0: [5, 6], 1: [7, 8]}, {0: [9, 10], 1: [11, 12]}]
    tokens, n_expert = trace_tokens(_csv(tmp_path / "t.csv", steps))
    assert n_expert == 40
    assert tokens == [{la: tuple(ids) for la, ids in s.items()} for s in steps]
    if REAL.is_file():
        real, n = trace_tokens(REAL)
        assert n == 128 and len(real) == 29 + 128 and all(len(t) == 30 for t in real)


class Spy:
    """The host copy's executor, keeping the ids each call was given."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.seen: list[tuple[int, np.ndarray]] = []

    def token_call(self, layer: int) -> None:
        return None

    def account(self, *a: object) -> None:
        pass

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.seen.append((layer, ids.numpy().copy()))
        return self.inner(layer, x, ids, weights)  # type: ignore[operator]


def test_the_executor_gets_the_traces_experts_mapped_onto_the_model(tmp_path: Path) -> None:
    # The model: 3 MoE layers of 16 experts, 2 per token; the trace: 2 layers, ids up to 39.
    steps = [{0: [1, 20], 1: [3, 1]}, {0: [33, 2], 1: [2, 7]}]
    trace = _csv(tmp_path / "t.csv", steps)
    lm = load_model(tiny_moe(tmp_path / "m.gguf", n_expert=16, n_layers=3), n_ctx=64)
    spy = Spy(lm.model.experts)
    lm.model.experts = ReplayedRouting(spy, trace, sorted(lm.model.host_experts.layers), 16)
    lm.model.drop_plans()
    prompt = lm.tokenizer.encode("one two three")
    events = list(generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=3, params=GREEDY,
                           ignore_eos=True))  # fmt: skip
    assert sum(isinstance(e, TokenEvent) for e in events) == 3
    n_prompt = len(prompt)
    # Token t takes trace token t % 2; model layer i the trace's layer i % 2; ids wrap at 16 (20 -> 4, 33 -> 1).
    want = {0: [[1, 4], [1, 2]], 1: [[3, 1], [2, 7]]}
    for layer, ids in spy.seen:
        tokens = range(n_prompt) if ids.shape[0] == n_prompt else None
        rows = ids.tolist()
        if tokens is not None:
            assert rows == [want[layer % 2][t % 2] for t in tokens], (layer, rows)
    decode = [ids.tolist() for layer, ids in spy.seen if ids.shape[0] == 1 and layer == 0]
    assert decode == [[want[0][t % 2]] for t in range(n_prompt, n_prompt + len(decode))]
    lm.close()


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_only_run_has_the_bench_switch(command: str, tmp_path: Path) -> None:
    trace = _csv(tmp_path / "t.csv", [{0: [1, 2]}])
    r = subprocess.run([sys.executable, "-m", "moechat", command, "--bench-replay-routing", str(trace)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--bench-replay-routing" in r.stderr and "Traceback" not in r.stderr


def test_run_says_the_text_is_not_the_models(tmp_path: Path) -> None:
    trace = _csv(tmp_path / "t.csv", [{0: [1, 2], 1: [3, 4]}])
    model = tiny_moe(tmp_path / "m.gguf", n_expert=16)
    r = subprocess.run([sys.executable, "-m", "moechat", "run", str(model), "-p", "hi", "-n", "3", "-c", "64",
                        "--bench-replay-routing", str(trace)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "the text is not the model's" in r.stderr


@pytest.mark.parametrize("recall", [0.0, 1.0])
def test_an_emulated_predictor_names_the_traces_next_experts_at_its_recall(recall: float, tmp_path: Path) -> None:
    steps = [{0: [1, 5], 1: [3, 9]}, {0: [2, 6], 1: [4, 11]}, {0: [7, 1], 1: [12, 3]}]
    trace = _csv(tmp_path / "t.csv", steps)
    lm = load_model(tiny_moe(tmp_path / "m.gguf", n_expert=16, n_layers=4), n_ctx=64, ram_cache_mib=0.6)
    tier = lm.ram_tier
    assert tier is not None
    lm.model.experts = ReplayedRouting(tier, trace, sorted(lm.model.host_experts.layers), 16, recall)
    lm.model.drop_plans()
    before = tier.snapshot()
    prompt = lm.tokenizer.encode("one two three")
    list(generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=6, params=GREEDY, ignore_eos=True))
    after = tier.snapshot()
    if recall == 0:
        assert after.prefetched == before.prefetched  # demand reads only
    else:
        assert after.prefetched > before.prefetched
        # Every expert a layer selected was predicted: the recall the tier counts is the emulated one.
        assert after.selected - before.selected == after.predicted_used - before.predicted_used > 0
    lm.close()
