"""The plan of a split over several hosts: contiguous layers, rank 0's ends, what each host needs."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from moechat.app.cli import main
from moechat.engine.distributed.plan import HEADROOM_BYTES, layer_weight_bytes, plan_split
from moechat.engine.models.opening import open_model
from moechat.engine.nn.layers import kv_cache_bytes, layer_state_bytes, recurrent_state_bytes
from testkit.ggufgen import ARCHS, HYBRID, tiny_moe

GIB = 2**30


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "qwen35moe"])
@pytest.mark.parametrize("n_hosts", [2, 3])
def test_a_split_covers_every_layer_once_and_each_host_maps_its_own(tmp_path: Path, arch: str, n_hosts: int) -> None:
    path = tiny_moe(tmp_path / "m.gguf", arch=arch, n_layers=6, n_expert=8, n_expert_used=2)
    gguf, cfg = open_model(path)
    with gguf:
        plan = plan_split(gguf, cfg, [64 * GIB] * n_hosts, 512)
        weights, ends = layer_weight_bytes(gguf, cfg)
        skipped = sum(t.n_bytes for t in gguf.tensors.values()
                      if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= cfg.n_layers)  # fmt: skip
        total = sum(t.n_bytes for t in gguf.tensors.values())
    hosts = plan.hosts
    assert [h.rank for h in hosts] == list(range(n_hosts))
    assert hosts[0].first == 0 and hosts[-1].end == cfg.n_layers
    assert all(a.end == b.first for a, b in itertools.pairwise(hosts))  # contiguous, in rank order
    assert all(h.end > h.first for h in hosts)  # nobody idle while there are layers enough
    # Every tensor the decoder reads is mapped by exactly one host; rank 0 holds the embedding and head.
    assert sum(h.weight_bytes for h in hosts) == total - skipped == sum(weights) + ends
    assert hosts[0].weight_bytes == sum(weights[: hosts[0].end]) + ends
    # State: the KV cache (and linear attention's state) of each host's own layers, as the engine allocates it.
    assert sum(h.state_bytes for h in hosts) == kv_cache_bytes(cfg, 512) + recurrent_state_bytes(cfg)
    assert plan.wire_bytes_per_token == n_hosts * cfg.n_embd * 4
    assert plan.misfit() is None and all(h.need_bytes == h.weight_bytes + h.state_bytes + HEADROOM_BYTES
                                         for h in hosts)  # fmt: skip


def test_the_split_balances_by_each_hosts_memory_and_names_a_host_that_does_not_fit(tmp_path: Path) -> None:
    path = tiny_moe(tmp_path / "m.gguf", n_layers=12, n_expert=16, n_expert_used=2, n_ff_exp=512)
    gguf, cfg = open_model(path)
    with gguf:
        weights, _ = layer_weight_bytes(gguf, cfg)
        layer = weights[0] + layer_state_bytes(cfg, 0, 256)
        even = plan_split(gguf, cfg, [HEADROOM_BYTES + 8 * layer] * 2, 256)
        # A host with three times the room (beyond the headroom) takes most of the layers.
        uneven = plan_split(gguf, cfg, [HEADROOM_BYTES + 4 * layer, HEADROOM_BYTES + 12 * layer], 256)
        # Too little for everything: the plan says which host overflows.
        tight = plan_split(gguf, cfg, [HEADROOM_BYTES + 3 * layer] * 3, 256)
    assert [len(h.layers) for h in even.hosts] in ([6, 6], [5, 7])  # rank 0 also holds the ends
    assert len(uneven.hosts[1].layers) > 2 * len(uneven.hosts[0].layers)
    bad = tight.misfit()
    assert bad is not None and not bad.fits and bad.need_bytes > bad.memory_bytes
    # The fullest host of the best split is no fuller than that of any other cut into two ranges.
    gguf, cfg = open_model(path)
    with gguf:
        weights, ends = layer_weight_bytes(gguf, cfg)
    state = [layer_state_bytes(cfg, i, 256) for i in range(cfg.n_layers)]
    memory = [h.memory_bytes for h in uneven.hosts]
    fullest = max(h.need_bytes / h.memory_bytes for h in uneven.hosts)
    for cut in range(1, cfg.n_layers):
        need0 = sum(weights[:cut]) + ends + sum(state[:cut]) + HEADROOM_BYTES
        need1 = sum(weights[cut:]) + sum(state[cut:]) + HEADROOM_BYTES
        assert fullest <= max(need0 / memory[0], need1 / memory[1]) + 1e-12, cut


def test_inspect_prints_the_plan_and_fails_when_a_host_is_too_small(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # the table's rows unwrapped
    path = tiny_moe(tmp_path / "m.gguf", n_layers=4)
    gguf, cfg = open_model(path)
    with gguf:
        plan = plan_split(gguf, cfg, [16 * GIB] * 2, cfg.n_ctx_train)
    assert main(["inspect", str(path), "--hosts", "2", "--host-memory", "16"]) == 0
    out = capsys.readouterr().out
    h0, h1 = plan.hosts
    span = [f"{h.first}" if h.end == h.first + 1 else f"{h.first}-{h.end - 1}" for h in plan.hosts]
    assert "a split over 2 hosts" in out and f"{span[0]} + embedding, head" in out and f"│ {span[1]} " in out
    assert h0.end == h1.first
    assert f"on the wire per decode token: {2 * 256 * 4:,} bytes" in out
    assert main(["inspect", str(path), "--hosts", "2", "--host-memory", "16", "1"]) == 1
    out = capsys.readouterr().out
    assert "host 1 needs" in out and "does not fit" in out and "NO" in out
    # Bad plan arguments: one line, exit 2.
    for argv, words in ((["--hosts", "0"], "--hosts must be at least 1"),
                        (["--hosts", "3", "--host-memory", "8", "8"], "one per host (3), got 2"),
                        (["--hosts", "2", "--host-memory", "-1"], "above 0 GiB"),
                        (["--hosts", "9"], "9 hosts for 4 layers")):  # fmt: skip
        t = time.perf_counter()
        assert main(["inspect", str(path), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "Traceback" not in err, err
        assert time.perf_counter() - t < 30


def test_every_family_has_a_plan(tmp_path: Path) -> None:
    for arch in ARCHS:
        path = tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, n_layers=4, n_expert=8, n_expert_used=2)
        gguf, cfg = open_model(path)
        with gguf:
            plan = plan_split(gguf, cfg, [32 * GIB] * 2, 128)
        assert plan.hosts[1].end == cfg.n_layers and plan.hosts[1].state_bytes > 0, arch
        if arch in HYBRID:  # linear attention's state does not grow with the context
            with open_model(path)[0] as gguf2:
                longer = plan_split(gguf2, cfg, [32 * GIB] * 2, 4096)
            linear = [i for i in range(cfg.n_layers) if cfg.is_recurrent(i)]
            assert linear and all(layer_state_bytes(cfg, i, 128) == layer_state_bytes(cfg, i, 4096) for i in linear)
            assert sum(h.state_bytes for h in longer.hosts) > sum(h.state_bytes for h in plan.hosts)
