"""A model split over 2 and 3 processes on this machine (gloo on 127.0.0.1): the same greedy tokens as one process."""

from __future__ import annotations

import re
import subprocess
import sys
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


@pytest.mark.slow
def test_moechat_run_under_torchrun_is_one_process_to_the_user(tmp_path: Path) -> None:
    """`torchrun ... -m moechat run`: rank 0 prints what one process prints (rank 1 nothing), and the
    cache summary counts every layer's lookups over both stages."""
    path = tiny_moe(tmp_path / "m.gguf", n_layers=4)
    flags = ["run", str(path), "-p", PROMPT, "-n", "10", "--temp", "0", "--raw", "-t", "1",
             "--moe-cache-mib", "0.5", "--moe-cache-cpu-share", "0.5"]  # fmt: skip
    one = subprocess.run([sys.executable, "-m", "moechat", *flags], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.run([*torchrun, "-m", "moechat", *flags], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.strip()

    def lookups(err: str) -> int:
        m = re.search(r"hits = (\d+), misses = (\d+)", err)
        assert m is not None, err[-2000:]
        return int(m.group(1)) + int(m.group(2))

    assert lookups(two.stderr) == lookups(one.stderr) > 0
