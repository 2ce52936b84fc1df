"""The RAM tier: experts read from the file into RAM slots never change what the model computes, the
tier sizes itself, a file larger than memory maps, and a bad read ends the reply in one line."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from moechat.engine.cache.ram_size import RUNTIME, USABLE, plan
from moechat.engine.cache.ram_tier import RamTierError
from moechat.engine.errors import ParameterError
from moechat.engine.events import GREEDY, TokenEvent
from moechat.engine.generate import generate
from moechat.engine.gguf.reader import GGUFFile
from moechat.engine.loader import LoadedModel, load_model
from testkit.ggufgen import ARCHS, Q, tiny_moe

PROMPT = "In the spring the river rose and the ferry stopped, so the villagers"
N_CTX = 128


def _tokens(lm: LoadedModel, n: int = 24) -> list[int]:
    prompt = lm.tokenizer.encode(PROMPT)
    events = generate(lm.model, lm.tokenizer, prompt, lm.new_cache(), max_tokens=n, params=GREEDY, ignore_eos=True)
    return [e.token for e in events if isinstance(e, TokenEvent) and e.token >= 0]


def _host_mib(lm: LoadedModel, fraction: float) -> float:
    """The emulated memory that leaves a tier of `fraction` of the experts after the rest of the model."""
    fit = lm.ram_fit
    assert fit is not None
    return (fit.dense + fit.kv + fit.scratch + fraction * fit.experts) / 2**20


@pytest.mark.parametrize("arch", ARCHS)
def test_the_ram_tier_never_changes_the_greedy_tokens(arch: str, tmp_path: Path) -> None:
    qtype = Q.MXFP4 if arch == "gpt-oss" else Q.Q8_0
    # Four layers: the scratch bank (one layer's experts) leaves room for a tier of half the experts.
    path = tiny_moe(tmp_path / f"{arch}.gguf", arch=arch, expert_type=qtype, n_expert=16, n_layers=4)
    ref_lm = load_model(path, n_ctx=N_CTX)
    assert ref_lm.ram_tier is None  # a model that fits keeps every expert in RAM, as before
    reference = _tokens(ref_lm)
    sizes = {f: _host_mib(ref_lm, f) for f in (0.1, 0.25, 0.5)}
    ref_lm.close()
    for fraction, host_mib in sizes.items():
        lm = load_model(path, n_ctx=N_CTX, emulate_host_mib=host_mib)
        tier = lm.ram_tier
        assert tier is not None and lm.ram_fit is not None
        assert lm.ram_fit.fraction == pytest.approx(fraction, abs=0.01)
        assert _tokens(lm) == reference, fraction
        snap = tier.snapshot()
        assert snap.n_slots < snap.n_expert_total
        assert snap.reads > 0 and snap.hits > 0, snap  # it read from the file, and it kept some
        assert snap.hits + snap.reads == snap.lookups  # every expert looked up was in RAM or read
        assert snap.predicted_used <= snap.selected and snap.prefetch_used <= snap.prefetched
        assert snap.bytes_read > 0
        lm.close()


def test_counters_count_the_bytes_read(tmp_path: Path) -> None:
    path = tiny_moe(tmp_path / "m.gguf", n_expert=16)
    lm = load_model(path, n_ctx=N_CTX, ram_cache_mib=1.0)
    tier = lm.ram_tier
    assert tier is not None
    expert_bytes = tier.groups[0].info.expert_bytes
    _tokens(lm, 12)
    snap = tier.snapshot()
    # Every expert read on demand or ahead is read whole, once.
    assert snap.bytes_read == (snap.reads + snap.prefetched) * expert_bytes
    assert snap.prefetched > 0 and 0 < snap.recall <= 1
    lm.close()


def test_without_look_ahead_nothing_is_read_ahead_and_the_tokens_are_the_same(tmp_path: Path) -> None:
    from moechat.engine.cache.ram_tier import RamTier

    path = tiny_moe(tmp_path / "m.gguf", n_expert=16)
    lm = load_model(path, n_ctx=N_CTX, ram_cache_mib=1.0)
    with_ahead = _tokens(lm)
    assert lm.ram_tier is not None
    lm.ram_tier.close()
    lm.ram_tier = RamTier(lm.model.host_experts, lm.gguf, lm.config.n_expert_used, 1.0, prefetch=False)
    lm.set_cache(None)
    assert _tokens(lm) == with_ahead
    snap = lm.ram_tier.snapshot()
    assert snap.prefetched == 0 and snap.reads > 0
    lm.close()


def test_auto_keeps_every_expert_in_ram_when_they_fit_and_refuses_what_cannot_fit(tmp_path: Path) -> None:
    path = tiny_moe(tmp_path / "m.gguf", n_expert=16)
    with GGUFFile(path) as gguf:
        lm = load_model(path, n_ctx=N_CTX, ram_cache_mib=0)
        cfg = lm.config
        lm.close()
        fit = plan(gguf, cfg, N_CTX, -1.0)
        assert fit.tier == 0 and fit.experts > 0 and fit.dense + fit.experts <= gguf.size
        # Auto's usable memory: a stated share of what is available, less the runtime's reserve.
        assert fit.usable <= USABLE * (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) - RUNTIME
        host = (fit.dense + fit.kv + fit.scratch) / 2**20 + 1.0
        small = plan(gguf, cfg, N_CTX, -1.0, emulate_host_mib=host)
        assert small.tier == pytest.approx(2**20, abs=2)  # what the dense part, the KV cache and the scratch leave
        with pytest.raises(ParameterError, match="does not fit.*smaller quant.*-c"):
            plan(gguf, cfg, N_CTX, -1.0, emulate_host_mib=fit.dense / 2**20)
        assert plan(gguf, cfg, N_CTX, 10_000.0).tier == 0  # a tier larger than the experts: all in RAM


def test_the_cli_refuses_a_model_that_cannot_fit_in_one_line(tmp_path: Path) -> None:
    path = tiny_moe(tmp_path / "m.gguf", n_expert=16)
    r = subprocess.run([sys.executable, "-m", "moechat", "run", str(path), "-p", "hi", "-n", "2",
                        "--emulate-host-mib", "1"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not fit" in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_a_file_larger_than_memory_maps(tmp_path: Path) -> None:
    """A private writable map reserves nothing (MAP_NORESERVE): a file twice the machine's memory opens."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows = (2 * ram) // (4096 * 4) + 1
    path = tmp_path / "huge.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor_info("huge.weight", (rows, 4096), np.dtype(np.float32), rows * 4096 * 4,
                      raw_dtype=GGMLQuantizationType.F32)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:  # the data as a hole: nothing is written
        end = f.seek(0, os.SEEK_END)
        f.truncate(-(-end // 32) * 32 + rows * 4096 * 4)
    with GGUFFile(path) as g:
        assert g.size > ram
        data = g.tensor_data("huge.weight")
        assert data.shape == (rows, 4096 * 4) and int(data[-1, -1]) == 0


def _truncated_model(tmp_path: Path) -> tuple[Path, int]:
    """A model whose last tensor (an expert tensor) loses its second half: experts 8.. of it cannot be read."""
    path = tiny_moe(tmp_path / "cut.gguf", n_expert=16)
    with GGUFFile(path) as g:
        last = max(g.tensors.values(), key=lambda t: t.offset)
        assert "_exps" in last.name
        cut = last.offset + last.n_bytes // 2
    return path, cut


def test_a_short_read_names_the_file_tensor_and_expert_and_ends_the_reply(tmp_path: Path) -> None:
    path, cut = _truncated_model(tmp_path)
    ref_lm = load_model(path, n_ctx=N_CTX, ram_cache_mib=0)
    reference = _tokens(ref_lm, 48)
    ref_lm.close()
    lm = load_model(path, n_ctx=N_CTX, ram_cache_mib=1.0)  # loaded whole, then the file is cut under it
    size = path.stat().st_size
    whole = path.read_bytes()
    os.truncate(path, cut)
    try:
        with pytest.raises(RamTierError) as e:
            _tokens(lm, 48)
        msg = str(e.value)
        assert str(path) in msg and "ffn_down_exps" in msg and "expert" in msg and "\n" not in msg
        with open(path, "r+b") as f:
            f.truncate(size)  # (the map's pages past the cut must exist again before it is used or closed)
            f.seek(cut)
            f.write(whole[cut:])
        # The slot a read failed into is not used as if it held the expert: the file whole again, the next
        # reply is the model's.
        assert _tokens(lm, 48) == reference
    finally:
        lm.close()
    assert path.read_bytes() == whole


@pytest.mark.parametrize("refuses", ["open", "read"])
def test_a_file_system_without_direct_reads_falls_back_and_says_so_once(
    refuses: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As tmpfs before Linux 6.6 and some network mounts do: O_DIRECT refused at open, or at the first read."""
    path = tiny_moe(tmp_path / "m.gguf", n_expert=16)
    ref_lm = load_model(path, n_ctx=N_CTX, ram_cache_mib=0)
    reference = _tokens(ref_lm)
    ref_lm.close()
    real_open, real_preadv = os.open, os.preadv
    direct_fds: set[int] = set()

    def open_(p: object, flags: int, *a: object) -> int:
        if flags & os.O_DIRECT and refuses == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(p, flags, *a)  # type: ignore[arg-type]
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "preadv", preadv)
    with caplog.at_level(logging.WARNING, logger="moechat.engine.gguf.direct_read"):
        lm = load_model(path, n_ctx=N_CTX, ram_cache_mib=1.0)
        assert _tokens(lm) == reference
        assert lm.ram_tier is not None and not lm.ram_tier.reader.direct
        assert lm.ram_tier.snapshot().reads > 0
        lm.close()
    said = [r for r in caplog.records if "no direct reads" in r.getMessage()]
    assert len(said) == 1


def test_the_apps_cache_note_says_the_experts_run_from_the_ram_tier(tmp_path: Path) -> None:
    from moechat.app.real_engine import auto_words
    from moechat.engine.cache.settings import AUTO_MIB, CacheSettings

    path = tiny_moe(tmp_path / "m.gguf", n_expert=16)
    lm = load_model(path, n_ctx=N_CTX, ram_cache_mib=1.0, cache=CacheSettings(mib=AUTO_MIB))
    assert lm.cache is None and lm.ram_tier is not None
    assert auto_words(lm) == f"off: the experts run from a RAM tier of 1 MiB ({100 * lm.ram_fit.fraction:.0f}% of them)"
    lm.close()
