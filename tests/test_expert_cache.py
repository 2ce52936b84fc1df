"""The expert cache in the engine: it never changes what the model computes, and its numbers add up."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from moechat.engine.cache.policy import POLICIES, ClassLRU, CpuShare, bypasses
from moechat.engine.cache.settings import CacheError, CacheSettings
from moechat.engine.cache.trace import read_trace
from moechat.engine.errors import ParameterError
from moechat.engine.events import GREEDY, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import LoadedModel, load_model
from moechat.engine.moe.expert_tensors import load_layer_experts
from testkit.ggufgen import ARCHS, MemoryModel, Q, tiny_moe, tiny_moe_parts

PROMPT = "In the spring the river rose and the ferry stopped, so the villagers"
N_TOKENS = 24
EXPERT_MIB = 2 * 8 * 3 * 256 * 272 / 2**20  # 2 layers x 8 experts x (gate, up, down) of Q8_0 256x256


def _tokens(lm: LoadedModel, prompt: list[int]) -> list[int]:
    events = generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=N_TOKENS, params=GREEDY,
                      ignore_eos=True)  # fmt: skip
    return [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_never_changes_the_greedy_tokens(arch: str, tmp_path: Path) -> None:
    qtype = Q.MXFP4 if arch == "gpt-oss" else Q.Q8_0
    path = tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=qtype)
    ref_lm = load_model(path, n_ctx=128)
    prompt = ref_lm.tokenizer.encode(PROMPT)
    reference = _tokens(ref_lm, prompt)
    expert_mib = ref_lm.cache.snapshot().groups[0].expert_bytes if ref_lm.cache else None
    assert expert_mib is None  # no cache unless asked
    total_mib = sum(lx.bytes_per_expert * 8 for lx in ref_lm.model.host_experts.layers.values()) / 2**20
    for mib in (0.25 * total_mib, total_mib):
        for share in (0.0, 0.5, 0.95):
            lm = load_model(path, n_ctx=128, cache=CacheSettings(mib=mib, cpu_share=share))
            assert lm.cache is not None
            assert _tokens(lm, prompt) == reference, (mib, share)
            total = lm.cache.snapshot().total
            assert total.hits > 0 and total.lookups > 0
            if share and mib < total_mib:
                assert total.cpu > 0, "the CPU share was never used"
            lm.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_no_cache_policy_changes_the_greedy_tokens(arch: str, tmp_path: Path) -> None:
    qtype = Q.MXFP4 if arch == "gpt-oss" else Q.Q8_0
    path = tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=qtype, n_expert=16)
    ref_lm = load_model(path, n_ctx=128)
    prompt = ref_lm.tokenizer.encode(PROMPT)
    reference = _tokens(ref_lm, prompt)
    total_mib = sum(lx.bytes_per_expert * 16 for lx in ref_lm.model.host_experts.layers.values()) / 2**20
    for policy in POLICIES:
        lm = load_model(path, n_ctx=128, cache=CacheSettings(mib=0.3 * total_mib, policy=policy))
        assert lm.cache is not None
        assert _tokens(lm, prompt) == reference, policy
        refused = lm.cache.snapshot().total.cpu
        assert (refused > 0) == (policy != "classlru"), (policy, refused)  # share 0: only the policy sends any
        lm.close()
    for share in (0.0, 0.5):  # next-layer prefetch: only where experts run changes, never what they compute
        lm = load_model(
            path, n_ctx=128, cache=CacheSettings(mib=0.3 * total_mib, cpu_share=share, prefetch="next-layer")
        )
        assert lm.cache is not None
        assert _tokens(lm, prompt) == reference, ("prefetch", share)
        t = lm.cache.snapshot().total
        assert t.prefetched > 0 and t.prefetch_hits > 0
        lm.close()


def _memory_layer() -> MemoryModel:
    return MemoryModel(*tiny_moe_parts(n_layers=1, n_expert=4)[:3])


class StepClock:
    """The emulated link's clock, stepped by the test: sleeping advances it and is counted."""

    def __init__(self) -> None:
        self.t = 100.0
        self.slept = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
        self.slept += seconds


def test_an_upload_ahead_runs_on_the_emulated_link_while_the_device_computes() -> None:
    """Demand uploads make the device wait bytes / speed; an upload made ahead costs only what the
    compute meanwhile did not cover (the bound is the link time itself, set here to 80 ms)."""
    from moechat.engine.cache.slot_groups import SlotGroup
    from moechat.engine.cache.stats import GroupInfo
    from moechat.engine.cache.uploads import Uploader

    lx = load_layer_experts(_memory_layer(), 0)
    link_s = 0.08
    group = SlotGroup(
        GroupInfo(0, (0,), 4, int(link_s * 1e9), 2, 0),
        None,
        tuple(torch.empty((2, *t.raw.shape[1:]), dtype=torch.uint8) for t in (lx.gate, lx.up, lx.down)),
    )
    clock = StepClock()
    up = Uploader(torch.device("cpu"), emulate_link_gbps=1.0, clock=clock)  # one "expert" costs link_s seconds

    def run(ahead: bool, compute_s: float) -> float:
        """Seconds the device waited for the link around `compute_s` of its own work."""
        waited = clock.slept
        up.upload(group, lx, ((1, 0),), ahead=ahead)
        clock.t += compute_s  # the device computes meanwhile
        up.wait_ahead()
        return clock.slept - waited

    assert run(ahead=False, compute_s=link_s) == pytest.approx(link_s)  # a demand upload: the whole link time
    assert run(ahead=True, compute_s=link_s) == 0.0  # made ahead: the compute covered it
    assert run(ahead=True, compute_s=link_s / 4) == pytest.approx(link_s * 3 / 4)  # only the rest is waited
    assert torch.equal(group.banks[0][0], lx.gate.raw[1])  # and the expert is in its slot


def test_uploads_told_afterwards_cost_what_they_would_have_cost_at_once() -> None:
    """A decode token's lookups and prefetches told at its end (`told`, `waited`), each with the time it was asked
    for: the device's timeline is shifted by every wait before, and the sum is slept once, at `pay`. A prefetch
    asked for a layer's time before its lookup hides that much of its link time; a demand miss hides none."""
    from moechat.engine.cache.uploads import Uploader

    clock = StepClock()
    up = Uploader(torch.device("cpu"), emulate_link_gbps=1.0, clock=clock)
    gb = 10**9  # one second on the link
    # Layer a: a demand miss at t=0 (1 s). Layer b: its prediction made at t=0.2 (device time), its lookup at
    # t=0.7 reads it. Layer c: a demand miss at t=0.9. All told at t=1.0, after the token computed.
    clock.t = 1.0
    up.told(gb, 0.0, ahead=False)  # the device waits until 1.0: every later time is 1 s later
    up.told(gb, 0.2, ahead=True)  # asked at device time 1.2; the link is free at 1.0: done at 2.2
    up.waited(0.7)  # the lookup at device time 1.7 waits for it: until 2.2 (the shift is now 1.5 s)
    up.told(gb, 0.9, ahead=False)  # asked at 2.4, the link free: done at 3.4 (shift 2.5 s)
    up.pay()
    assert clock.slept == pytest.approx(2.5)
    # The same without the prediction's head start (asked at its lookup): a second layer's full link time.
    clock2 = StepClock()
    up2 = Uploader(torch.device("cpu"), emulate_link_gbps=1.0, clock=clock2)
    clock2.t = 1.0
    up2.told(gb, 0.0, ahead=False)
    up2.told(gb, 0.7, ahead=False)
    up2.told(gb, 0.9, ahead=False)
    up2.pay()
    assert clock2.slept == pytest.approx(3.0) and clock2.slept - clock.slept == pytest.approx(0.5)


@pytest.mark.parametrize("kernels", ["fast", "int16", "int8"])
def test_cached_logits_are_bit_identical_on_the_cpu_device(kernels: str, tmp_path: Path) -> None:
    path = tiny_moe(tmp_path / "m.gguf")
    plain = load_model(path, n_ctx=64, cpu_kernels=kernels)
    cached = load_model(path, n_ctx=64, cache=CacheSettings(mib=EXPERT_MIB / 4, cpu_share=0.5), cpu_kernels=kernels)
    ids = plain.tokenizer.encode(PROMPT)[:8]
    c1, c2 = plain.new_cache(), cached.new_cache()
    with torch.inference_mode():
        for t in ids:  # one token at a time: every call goes through the cache
            a = plain.model(torch.tensor([t]), c1.pos, c1)
            b = cached.model(torch.tensor([t]), c2.pos, c2)
            assert torch.equal(a, b)
    assert cached.cache is not None and cached.cache.snapshot().total.cpu > 0
    # On the CPU device the share runs inline: no thread is handed work smaller than the hand-off.
    assert cached.cache._worker is None
    # Without an emulated link the slots read the host copy in place: no second copy of the experts in
    # memory, while the counters still count what a device would have uploaded.
    assert cached.cache.in_place and not any(g.banks for g in cached.cache.groups)
    assert cached.cache.snapshot().total.uploads > 0


def test_statistics_add_up_and_the_trace_replays_them(tmp_path: Path) -> None:
    path = tiny_moe(tmp_path / "m.gguf")
    trace = tmp_path / "run.trace"
    settings = CacheSettings(mib=EXPERT_MIB * 0.4, cpu_share=0.5, trace=trace)
    lm = load_model(path, n_ctx=128, cache=settings)
    assert lm.cache is not None
    prompt = lm.tokenizer.encode(PROMPT * 3)  # > 32 tokens: the prefill bypasses the cache
    assert len(prompt) > 32
    _tokens(lm, prompt)
    snap = lm.cache.snapshot()
    expert_bytes = snap.groups[0].expert_bytes
    for layer in snap.layers:
        for c in (layer.small, layer.large):
            assert c.hits + c.misses == c.lookups
            assert c.misses == c.uploads + c.cpu
            assert c.uploaded_bytes == c.uploads * expert_bytes
        assert layer.large.bypassed > 0 and layer.large.lookups == 0  # the prefill
        assert layer.small.lookups > 0
        # Every token's selections, those around the cache (the prefill) and those it planned, counted once.
        assert sum(layer.use_counts) == 2 * (layer.small.tokens + layer.large.tokens)
    lm.close()

    # A minimal replay of the trace through the same policy code gives the same counters.
    tr = read_trace(trace)
    groups = tr.header["groups"]
    assert len(groups) == 1 and groups[0]["n_slots"] == snap.groups[0].n_slots
    g = groups[0]
    policy = ClassLRU(g["layers"], g["n_expert"], g["n_slots"])
    share = CpuShare(tr.header["cpu_share"])
    got: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    assert tr.header["predictions"] and not tr.header["prefetch"]
    assert any(rec.layer < 0 for rec in tr)  # each layer's prediction one layer ahead, recorded though not fetched
    for rec in tr:
        if rec.layer < 0:
            continue
        if bypasses(rec.n_tokens, rec.n_used, g["n_expert"], g["n_slots"], tr.header["max_batch"]):
            got[rec.layer]["bypassed"] += len(set(rec.ids))
            continue
        plan = policy.plan(rec.layer, rec.ids, rec.n_tokens, share.active())
        got[rec.layer]["hits"] += len(plan.hits)
        got[rec.layer]["uploads"] += len(plan.uploads)
        got[rec.layer]["cpu"] += len(plan.cpu)
    for layer in snap.layers:
        t = layer.total
        assert dict(got[layer.layer]) == {"bypassed": t.bypassed, "hits": t.hits, "uploads": t.uploads, "cpu": t.cpu}
        assert layer.occupancy == sum(1 for s in policy.slot_map[layer.layer] if s >= 0)


def test_prefill_leaves_the_cache_state_alone(tmp_path: Path) -> None:
    lm = load_model(tiny_moe(tmp_path / "m.gguf"), n_ctx=128, cache=CacheSettings(mib=EXPERT_MIB / 2))
    assert lm.cache is not None
    policy = lm.cache.groups[0].policy
    assert policy is not None
    ids = torch.tensor(lm.tokenizer.encode(PROMPT * 3)[:40])
    with torch.inference_mode():
        lm.model(ids, 0, lm.new_cache())
    assert policy.n_filled == 0 and not any(policy.clock) and not any(policy.crf)
    with torch.inference_mode():
        lm.model(ids[:4], 0, lm.new_cache())  # a small batch does use it
    assert policy.n_filled > 0


def test_groups_split_the_budget_by_expert_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tiny_moe(tmp_path / "m.gguf", n_layers=3, layer_expert_types={2: Q.Q4_K})
    with caplog.at_level(logging.INFO):
        lm = load_model(path, n_ctx=64, cache=CacheSettings(mib=2.0))
    assert lm.cache is not None
    infos = [g.info for g in lm.cache.groups]
    assert [i.layers for i in infos] == [(0, 1), (2,)]
    q8, q4 = infos
    assert q8.expert_bytes == 3 * 256 * 272 and q4.expert_bytes == 3 * 256 * 144
    assert abs(q8.fraction - q4.fraction) < 0.1  # the same share of each group's experts
    assert q8.budget_bytes + q4.budget_bytes <= 2 * 2**20
    assert "slots" in caplog.text and "tokens worth" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        tiny = load_model(path, n_ctx=64, cache=CacheSettings(mib=0.3))
    assert tiny.cache is not None and all(g.policy is None for g in tiny.cache.groups)
    assert "cannot hold one token's 2 experts: not cached" in caplog.text


@pytest.mark.parametrize(
    ("settings", "parameter", "msg"),
    [
        (CacheSettings(mib=-2), "mib", "cache size must be >= 0 MiB"),  # (-1: auto, resolved at load)
        (CacheSettings(mib=1, cpu_share=1.5), "cpu_share", r"CPU share must be in \[0, 1\]"),
        (CacheSettings(mib=1, emulate_link_gbps=-2), "emulate_link_gbps", "emulated link must be >= 0"),
        (CacheSettings(mib=1, emulate_link_gbps=16, device="cuda"), "emulate_link_gbps", "only applies to the CPU"),
        (CacheSettings(mib=1, policy="fifo"), "policy", "cache policy must be one of"),
    ],
)
def test_bad_settings(settings: CacheSettings, parameter: str, msg: str) -> None:
    """The engine says what is wrong in its own words, naming its parameter, never a front end's flag."""
    with pytest.raises(CacheError, match=msg) as info:
        settings.validate()
    assert info.value.parameter == parameter and "--" not in str(info.value)


@pytest.mark.slow
def test_cli_cache_flags_and_env(tmp_path: Path) -> None:
    model = tiny_moe(tmp_path / "m.gguf", n_vocab=300)
    base = [sys.executable, "-m", "moechat", "run", str(model), "-p", "Hello", "-n", "8", "--ignore-eos", "--temp", "0"]
    r = subprocess.run([*base, "--moe-cache-mib", "1", "--moe-cache-cpu-share", "0.5", "--emulate-link-gbps", "16"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "MoE cache: batch <= 8: hits = " in r.stderr
    env = {"MOECHAT_MOE_CACHE_MIB": "1", "MOECHAT_MOE_CACHE_CPU_SHARE": "2", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    # The message names the setting and where the bad value came from.
    assert (
        r.returncode == 2
        and "moe_cache_cpu_share from env MOECHAT_MOE_CACHE_CPU_SHARE: 2.0 must be in [0, 1]" in r.stderr
    )
    r = subprocess.run([*base, "--device", "tpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "device from flag --device: 'tpu' must be auto, cpu or cuda" in r.stderr
    r = subprocess.run([*base, "--moe-cache-mib", "-3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "moe_cache_mib from flag --moe-cache-mib: -3.0 must be >= 0" in r.stderr


def test_snapshots_are_frozen_and_count_every_token(tmp_path: Path) -> None:
    import dataclasses

    lm = load_model(tiny_moe(tmp_path / "m.gguf"), n_ctx=256, cache=CacheSettings(mib=EXPERT_MIB / 2, cpu_share=0.5))
    assert lm.cache is not None
    prompt = lm.tokenizer.encode(PROMPT)
    before = lm.cache.snapshot()
    events = list(generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=60, ignore_eos=True))
    after = lm.cache.snapshot()
    assert getattr(events[-1], "n_generated", None) == 60
    assert before.tokens == 0 and before.total.lookups == 0
    assert after.tokens == len(prompt) + 59  # every token passed the first MoE layer (the last is not fed back)
    assert after.total.lookups > 0 and after.time >= before.time
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.__setattr__("tokens", 0)


def test_recent_window_counts_the_latest_tokens_from_cumulative_snapshots(tmp_path: Path) -> None:
    """The dashboard's "last 32 tokens": the difference of two snapshots of the real cache, per
    layer and in total, over a span of at least the window's tokens; a restarted cache restarts it."""
    from moechat.engine.cache.stats import RecentWindow
    from moechat.engine.events import TokenEvent

    lm = load_model(tiny_moe(tmp_path / "m.gguf", n_layers=3), n_ctx=256, cache=CacheSettings(mib=EXPERT_MIB / 2))
    assert lm.cache is not None
    window = RecentWindow(tokens=16)
    snaps, recents = [], []
    prompt = lm.tokenizer.encode("one")
    for ev in generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=60, ignore_eos=True):
        if isinstance(ev, TokenEvent) and ev.index % 5 == 0:  # snapshots every 5 tokens, as a reader gets them
            snaps.append(lm.cache.snapshot())
            recents.append(window.add(snaps[-1]))
    assert recents[0] is None  # one snapshot: no span yet
    for i in range(4, len(snaps)):
        last, got = snaps[i], recents[i]
        assert got is not None
        base = max((s for s in snaps[:i] if s.tokens <= last.tokens - 16), key=lambda s: s.tokens)
        assert got.span == last.tokens - base.tokens and 16 <= got.span < 21
        assert got.total == last.total - base.total and got.total.lookups > 0
        before = {ls.layer: ls.total for ls in base.layers}
        assert dict(got.layers) == {ls.layer: ls.total - before[ls.layer] for ls in last.layers}
        worst = got.worst(2)
        rates = sorted(c.hit_rate for _, c in got.layers if c.lookups)
        assert [rate for _, rate in worst] == rates[:2]
    # The cache rebuilt: its counters start again, and so does the window.
    lm.set_cache(CacheSettings(mib=EXPERT_MIB / 2))
    assert window.add(lm.cache.snapshot()) is None


def _greedy(lm: LoadedModel, n: int = 24) -> list[int]:
    from moechat.engine.events import GREEDY, TokenEvent

    prompt = lm.tokenizer.encode(PROMPT)
    events = generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=n, params=GREEDY, ignore_eos=True)
    return [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]


def test_warm_start_fills_the_slots_before_the_first_token_and_changes_no_output(tmp_path: Path) -> None:
    import json

    path = tiny_moe(tmp_path / "m.gguf", n_layers=3, n_expert=16)
    warm = tmp_path / "warm" / "m.json"
    settings = CacheSettings(mib=EXPERT_MIB / 2, cpu_share=0.5, warm_start=warm)
    first = load_model(path, n_ctx=256, cache=settings)
    assert first.cache is not None and first.cache.snapshot().warm_uploads == 0  # nothing saved yet
    cold_tokens = _greedy(first)
    used = {ls.layer: ls.use_counts for ls in first.cache.snapshot().layers}
    cold_uploads = first.cache.snapshot().total.uploads
    first.close()
    saved = json.loads(warm.read_text())
    assert saved["version"] == 1 and sorted(saved["layers"]) == ["0", "1", "2"]
    for layer, counts in saved["layers"].items():
        # Decayed counts: only experts the run used have any (not all: the prompt's batch bypassed the cache).
        assert all(u > 0 for c, u in zip(counts, used[int(layer)], strict=True) if c > 0) and max(counts) > 0
        assert max(range(16), key=lambda e: counts[e]) in {e for e, u in enumerate(used[int(layer)]) if u}
    second = load_model(path, n_ctx=256, cache=settings)
    assert second.cache is not None
    snap = second.cache.snapshot()
    assert snap.tokens == 0 and snap.total.lookups == 0  # before the first token...
    n_slots = sum(g.n_slots for g in snap.groups)
    assert snap.warm_uploads == n_slots and snap.warm_bytes == n_slots * snap.groups[0].expert_bytes
    assert sum(ls.occupancy for ls in snap.layers) == n_slots  # ...the slots hold experts
    for ls in snap.layers:  # the hottest of each layer among them
        counts = saved["layers"][str(ls.layer)]
        assert max(range(16), key=lambda e: counts[e]) in ls.cached
    assert _greedy(second) == cold_tokens  # the cache never changes what the model computes
    assert second.cache.snapshot().total.uploads < cold_uploads  # the same reply, fewer experts to fetch
    second.close()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"version": 1, "layers": {"0": [1.0, 2.0]}}',
        '{"version": 7, "layers": {}}',
        '{"version": 1, "layers": {"0": "x"}}',
    ],
)
def test_warm_start_survives_a_corrupt_or_foreign_file(tmp_path: Path, content: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    import json
    import logging

    path = tiny_moe(tmp_path / "m.gguf", n_layers=2, n_expert=16)
    warm = tmp_path / "m.json"
    warm.write_text(content)
    with caplog.at_level(logging.WARNING, logger="moechat.engine.cache.warm_start"):
        lm = load_model(path, n_ctx=256, cache=CacheSettings(mib=EXPERT_MIB / 2, warm_start=warm))
    assert lm.cache is not None and lm.cache.snapshot().warm_uploads == 0  # cold, and running
    assert any("starting cold" in r.getMessage() for r in caplog.records)
    assert len(_greedy(lm, 4)) == 4
    lm.close()
    assert sorted(json.loads(warm.read_text())["layers"]) == ["0", "1"]  # replaced by this model's counts


def test_device_fetch_paths_read_each_experts_own_weights(tmp_path: Path) -> None:
    """The bypass's per-call upload and the slots' reads (the device paths) give each expert the
    weights gguf-py reads for it from the file: right expert, right slot, bytes intact."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize
    from moechat.engine.kernels import device as device_kernels

    if not device_kernels.available():
        pytest.skip("triton is not installed")
    path = tiny_moe(tmp_path / "m.gguf", n_expert=8)
    # The device's kernels (Triton's interpreter here): the CPU device's slots then hold copies, as a device's do.
    lm = load_model(path, n_ctx=64, cache=CacheSettings(mib=EXPERT_MIB / 2, device_kernels="triton"))
    assert lm.cache is not None and not lm.cache.in_place
    _tokens(lm, lm.tokenizer.encode(PROMPT)[:4])  # some decode steps: slots fill
    reader = GGUFReader(path)
    ref = {}
    for kind in ("gate", "up", "down"):
        t = next(t for t in reader.tensors if t.name == f"blk.0.ffn_{kind}_exps.weight")
        ref[kind] = torch.from_numpy(np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32))  # [E, R, C]
    lx = lm.model.host_experts.layers[0]
    group = lm.cache.group_of[0]
    assert group.policy is not None
    cached = [e for e, s in enumerate(group.policy.slot_map[0]) if s >= 0]
    assert cached and len(set(group.policy.slot_map[0][e] for e in cached)) == len(cached)
    upload = lm.cache._host_fetch(lx)
    slot = lm.cache._slot_fetch(group.policy, group.banks, lx, 0)
    for e in range(8):
        for kind, got in zip(("gate", "up", "down"), upload(e), strict=True):
            assert torch.equal(got, ref[kind][e]), (e, kind)
    for e in cached:
        for kind, got in zip(("gate", "up", "down"), slot(e), strict=True):
            assert torch.equal(got, ref[kind][e]), (e, kind)


def test_dequant_cache_is_exact_and_bounded(tmp_path: Path) -> None:
    """On the exact path, keeping dequantized experts (--cpu-dequant-mib) changes no logit, with or without the
    device cache."""
    path = tiny_moe(tmp_path / "m.gguf", n_layers=2, n_expert=8, n_expert_used=2)
    ids = torch.tensor(load_model(path, n_ctx=64).tokenizer.encode(PROMPT)[:10])
    expert_fp32 = 3 * 256 * 256 * 4  # one expert's gate, up and down in fp32

    def logits(**kw: object) -> tuple[torch.Tensor, LoadedModel]:
        lm = load_model(path, n_ctx=64, cpu_kernels="exact", **kw)
        kv = lm.new_cache()
        with torch.inference_mode():
            out = [lm.model(ids[i : i + 1], i, kv) for i in range(len(ids))]
        return torch.cat(out), lm

    ref, _ = logits()
    budget_mib = 3 * expert_fp32 / 2**20  # room for 3 experts: eviction happens
    got, lm = logits(cpu_dequant_mib=budget_mib)
    assert torch.equal(got, ref)
    dq = lm.model.host_experts.dequant
    assert dq is not None and dq.hits > 0 and dq.misses > 0 and 0 < dq.used <= dq.budget
    assert len(dq.items) <= 3
    got2, lm2 = logits(cpu_dequant_mib=64, cache=CacheSettings(mib=EXPERT_MIB / 2, cpu_share=0.5))
    assert torch.equal(got2, ref)
    assert lm2.model.host_experts.dequant is not None and lm2.model.host_experts.dequant.hits > 0
    with pytest.raises(ParameterError, match="budget must be >= 0 MiB") as info:
        load_model(path, n_ctx=64, cpu_dequant_mib=-1)
    assert info.value.parameter == "dequant_mib"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.py runs these)")
def test_pinned_experts_are_copied_once_per_model_and_keep_the_cpu_options(tmp_path: Path) -> None:
    lm = load_model(tiny_moe(tmp_path / "m.gguf"), n_ctx=64, cpu_kernels="int8", cpu_dequant_mib=4)
    first = lm.set_cache(CacheSettings(mib=EXPERT_MIB / 2, cpu_share=0.5, device="cuda", load_mode="pinned"))
    second = lm.set_cache(CacheSettings(mib=EXPERT_MIB / 4, cpu_share=0.5, device="cuda", load_mode="pinned"))
    assert first is not None and second is not None
    assert second.host is first.host  # the tuner's arms do not pin the experts again
    assert second.host.layers[0].gate.raw.is_pinned()
    assert (second.host.kernels, second.host.dequant_mib) == ("int8", 4)


def test_the_min_window_is_bounded_and_counts_what_the_cache_counted(tmp_path: Path) -> None:
    """The lookups kept for the MIN bound: the whole session while it is short, then a window of
    recent tokens whose length does not grow with the session; the cache's hits on the window are
    the difference of its own counters across it, and MIN (from the slots as they were at the
    window's start) is never below them."""
    from moechat.app.real_engine import RealEngine
    from moechat.engine.cache.lookup_log import LookupLog
    from moechat.tuner.baselines import min_hit_rate

    path = tiny_moe(tmp_path / "m.gguf", n_expert=8)
    lm = load_model(path, n_ctx=256, cache=CacheSettings(mib=EXPERT_MIB / 3, cpu_share=0.5))
    cache = lm.cache
    assert cache is not None
    window, every = 16, 4
    cache.log = LookupLog(cache.preloaded, window_tokens=window, every_tokens=every)  # a short window for the test
    engine = RealEngine(lm, CacheSettings())
    kv = lm.new_cache()
    totals = {}  # tokens seen -> the cache's counters then
    prompt = lm.tokenizer.encode(PROMPT)[:4]
    tok = int(prefill_one := lm.model(torch.tensor(prompt), 0, kv)[-1].argmax())
    del prefill_one
    n_layers = len(lm.model.host_experts.layers)
    for step in range(60):
        totals[cache.tokens] = cache.snapshot().total
        with torch.inference_mode():
            tok = int(lm.model(torch.tensor([tok]), kv.pos, kv)[-1].argmax())
        w = cache.log.window()
        if step == 8:
            assert w.from_start and w.hits == cache.snapshot().total.hits  # the session: the cache's own count
        if step >= 40:
            assert not w.from_start and window <= w.tokens <= window + every
            assert len(w.records) == w.tokens * n_layers  # bounded whatever the session's length
            before, now = totals[cache.tokens - w.tokens], cache.snapshot().total
            assert w.hits == now.hits - before.hits and w.lookups == now.lookups - before.lookups
    bound = engine.min_bound()
    assert bound is not None and not bound.from_start and bound.rate >= bound.hit_rate
    cold = min_hit_rate([g.info for g in cache.groups], 2, cache.settings.max_batch, w.records)
    assert cold is not None and bound.rate >= cold  # starting from the slots' experts, not from empty slots


def test_the_lookup_log_is_the_same_whether_the_compiled_lookup_or_python_wrote_it(tmp_path: Path) -> None:
    """The policy's compiled lookup appends each lookup to the log while the buffer has room; with no
    room the cache appends it itself and the buffer grows. Both give the same window: the same
    records, hits and lookups as the cache counted."""
    from moechat.engine.cache.lookup_log import LookupLog

    path = tiny_moe(tmp_path / "m.gguf", n_expert=8)
    windows = []
    for per_token in (64, 1):  # a roomy buffer, then one too small from the first token
        lm = load_model(path, n_ctx=128, cache=CacheSettings(mib=EXPERT_MIB / 3, cpu_share=0.5))
        cache = lm.cache
        assert cache is not None
        cache.log = LookupLog(cache.preloaded, per_token=per_token, window_tokens=16, every_tokens=4)
        size = cache.log.buf.size
        kv = lm.new_cache()
        tok = int(lm.model(torch.tensor(lm.tokenizer.encode(PROMPT)[:4]), 0, kv)[-1].argmax())
        for _ in range(12):
            with torch.inference_mode():
                tok = int(lm.model(torch.tensor([tok]), kv.pos, kv)[-1].argmax())
        w = cache.log.window()
        assert w.from_start and w.hits == cache.snapshot().total.hits and w.lookups == cache.snapshot().total.lookups
        assert (cache.log.buf.size > size) == (per_token == 1)
        windows.append(w)
        lm.close()
    assert windows[0] == windows[1] and len(windows[0].records) == 2 * 13  # 2 MoE layers, the prompt and 12 tokens
