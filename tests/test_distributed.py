"""A model split over 2 and 3 processes on this machine (gloo on 127.0.0.1): the same greedy tokens as one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.distributed.plan import plan_split
from moechat.engine.events import GREEDY, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.loader import load_model
from moechat.engine.models.opening import open_model
from testkit.distributed import N_TOKENS, PROMPT, run_ranks
from testkit.ggufgen import tiny_moe


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "qwen35moe"])
def test_a_split_model_writes_what_one_process_writes(tmp_path: Path, arch: str) -> None:
    path = tiny_moe(tmp_path / "m.gguf", arch=arch, n_layers=4, n_expert=8, n_expert_used=2)
    lm = load_model(path, n_ctx=256)
    moe_layers = sorted(lm.model.host_experts.layers)
    ids = lm.tokenizer.encode(PROMPT)
    reference = [e.token for e in generate(lm.model, lm.tokenizer, ids, lm.new_cache(), max_tokens=N_TOKENS,
                                           params=GREEDY, ignore_eos=True)
                 if isinstance(e, TokenEvent) and e.token >= 0]  # fmt: skip
    lm.close()
    assert len(reference) == N_TOKENS
    cache = CacheSettings(mib=1.5, cpu_share=0.5)  # each rank's own expert cache, with a CPU share
    for world, settings in ((2, None), (3, cache)):
        results = run_ranks(path, world, settings)
        assert results[0][0] == reference, (world, results)
        assert all(results[r][0] is None for r in range(1, world)), results  # the other ranks served
        merged, n_groups = results[0][2], results[0][3]
        if settings is None:
            assert merged is None  # no stage has a cache
        else:  # each stage's cache counted its own layers; rank 0 sees them all, by their own indices
            assert sorted(merged) == moe_layers, merged
            lookups = {n for n, _ in merged.values()}
            assert len(lookups) == 1 and lookups.pop() > 0  # every layer looked up every token
            assert {g for _, g in merged.values()} == set(range(n_groups)) and n_groups >= 2  # from several stages
        # Each rank has only its own part of the file in memory: its layers (rank 0: and the ends).
        gguf, cfg = open_model(path)
        with gguf:
            plan = plan_split(gguf, cfg, [64 * 2**30] * world, 256)
        page = 4096
        for h in plan.hosts:
            resident = results[h.rank][1]
            assert h.weight_bytes <= resident + page * 4 and resident <= h.weight_bytes * 1.02 + 64 * page, (
                world, h, resident)  # fmt: skip


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_run_on_rank_0_with_one_line() -> None:
    import tempfile
    import time

    from testkit.distributed import LOST_TIMEOUT_S, start_until_lost

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_moe(Path(tmp) / "m.gguf", n_layers=4, n_expert=8, n_expert_used=2)
        procs, out = start_until_lost(path, 3)
        try:
            assert out.get(timeout=300)[1] == "writing"  # the split runs
            procs[2].kill()  # the last rank, mid-reply
            killed = time.monotonic()
            while True:
                rank, message, *when = out.get(timeout=2 * LOST_TIMEOUT_S + 30)
                if rank == 0 and message != "writing":
                    break
            assert message.startswith("RankLost: a rank of the split stopped answering (")
            assert "\n" not in message and len(message) < 300
            assert when[0] - killed < LOST_TIMEOUT_S + 10  # within the group's timeout, not a hang
        finally:
            for p in procs:
                p.kill()
                p.join(10)


@pytest.mark.slow
def test_a_rank_with_another_file_is_refused_before_any_work(tmp_path: Path) -> None:
    same = tiny_moe(tmp_path / "m.gguf", n_layers=4, n_expert=8, n_expert_used=2)
    other = tiny_moe(tmp_path / "other.gguf", n_layers=4, n_expert=8, n_expert_used=2, seed=1)
    results = run_ranks([same, same, other], 3, None)
    for rank in range(3):  # every rank stops, each saying which rank differs
        assert results[rank] == ("ValueError: rank 2 runs another model file than rank 0: every host needs the "
                                 "very same file"), results  # fmt: skip
