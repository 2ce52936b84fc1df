"""Faults: stops at every stage, engine errors, a device without room, failing writes, corrupt stores, full context."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import pytest
from moechat.app.real_engine import RealEngine
from moechat.engine.cache.settings import CacheError, CacheSettings
from moechat.engine.events import GREEDY, DoneEvent, TokenEvent
from moechat.engine.loader import load_model
from moechat.tuner.events import N_ARMS, ArmDone, ArmProgress, ArmStarted, Cancelled, SweepDone
from testkit.ggufgen import tiny_moe

HELLO = [{"role": "user", "content": "Tell me about the river and the ferry."}]


def _engine(path: Path, mib: float = 1.0, share: float = 0.5, n_ctx: int = 1024) -> RealEngine:
    return RealEngine(load_model(path, n_ctx=n_ctx, cache=CacheSettings(mib=mib, cpu_share=share)), CacheSettings())


def _tokens(engine: RealEngine, n: int = 10, stop: threading.Event | None = None) -> list[int]:
    prompt, _, _ = engine.fit_messages(HELLO)
    return [e.token for e in engine.reply(prompt, GREEDY, n, stop or threading.Event())
            if isinstance(e, TokenEvent) and e.token >= 0]  # fmt: skip


def _consistent(engine: RealEngine) -> None:
    snap = engine.snapshot()
    assert snap is not None
    for layer in snap.layers:
        t = layer.total
        assert t.hits + t.misses == t.lookups and t.misses == t.uploads + t.cpu


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("faults") / "m.gguf", n_expert=8, n_expert_used=2)


@pytest.fixture(scope="module")
def reference(model: Path) -> list[int]:
    engine = _engine(model, mib=0.0)
    out = _tokens(engine)
    engine.close()
    return out


def test_stop_during_prefill_then_the_next_request_works(model: Path, reference: list[int]) -> None:
    engine = _engine(model)
    # A prompt longer than one ubatch: the stop lands between ubatches.
    long_prompt = engine.lm.tokenizer.encode("river ferry " * 400)[:700]
    stop = threading.Event()
    stop.set()
    events = list(engine.reply(long_prompt, GREEDY, 10, stop))
    assert isinstance(events[-1], DoneEvent) and events[-1].stop_reason == "stopped" and events[-1].n_generated == 0
    _consistent(engine)
    assert _tokens(engine) == reference
    engine.close()


@pytest.mark.parametrize("after", [1, 4])
def test_stop_during_decode_then_the_next_request_works(model: Path, reference: list[int], after: int) -> None:
    engine = _engine(model)
    stop = threading.Event()
    prompt, _, _ = engine.fit_messages(HELLO)
    got = []
    for ev in engine.reply(prompt, GREEDY, 50, stop):
        if isinstance(ev, TokenEvent) and ev.token >= 0:
            got.append(ev.token)
            if len(got) == after:
                stop.set()
        elif isinstance(ev, DoneEvent):
            assert ev.stop_reason == "stopped"
    assert got == reference[: len(got)] and len(got) <= after + 1
    _consistent(engine)
    assert _tokens(engine) == reference  # KV cache, expert cache and statistics all still fine
    engine.close()


def test_stop_in_every_calibration_arm_keeps_the_session(model: Path, reference: list[int], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("MOECHAT_HOME", str(tmp_path / "home"))
    engine = _engine(model, mib=1.0, share=0.5)
    runs = tmp_path / "home" / "cache" / "tune"
    # On the CPU device the six arms run together, a token of each in turn: a stop at any token of
    # any arm keeps none of them (none has finished), leaves no partial file and restores the session.
    for arm, at in ((0, 1), (3, 3), (5, 4), (6, 2)):  # progress comes at each of the first 4 tokens
        stop = threading.Event()
        with pytest.raises(Cancelled):
            for ev in engine.sweep(stop, None, 24):
                if isinstance(ev, ArmProgress) and ev.index == arm and ev.tokens_done >= at:
                    stop.set()
                assert not isinstance(ev, (SweepDone, ArmDone))
        assert engine.cache() == (1.0, 0.5), "the session's cache was not restored"
        assert not list(runs.rglob("*.json")) and not list(runs.rglob("*.part")) and not list(runs.rglob("*.tmp"))
        _consistent(engine)
    assert _tokens(engine) == reference
    # With nothing stopping it, the sweep finishes; the next one reuses all its arms (six, and cache off).
    events = list(engine.sweep(threading.Event(), None, 24))
    assert sum(isinstance(e, ArmStarted) for e in events) == N_ARMS and isinstance(events[-1], SweepDone)
    again = list(engine.sweep(threading.Event(), None, 24))
    assert not any(isinstance(e, ArmStarted) for e in again) and isinstance(again[-1], SweepDone)
    # One arm missing: it runs alone (as every arm does on a GPU), and a stop in it keeps the others.
    (kept,) = [p for p in runs.rglob("*.json") if p.name.startswith("run-") and p.name.endswith("-0.5.json")][:1]
    kept.unlink()
    stop = threading.Event()
    with pytest.raises(Cancelled):
        for ev in engine.sweep(stop, None, 24):
            if isinstance(ev, ArmProgress) and ev.tokens_done >= 2:
                stop.set()
    assert len(list(runs.rglob("*.json"))) == N_ARMS - 1 and not list(runs.rglob("*.part"))
    alone = list(engine.sweep(threading.Event(), None, 24))
    assert sum(isinstance(e, ArmStarted) for e in alone) == 1 and isinstance(alone[-1], SweepDone)
    assert engine.cache() == (1.0, 0.5)
    assert _tokens(engine) == reference
    engine.close()


def test_a_cache_larger_than_the_device_allows_proposes_one_that_fits(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import moechat.engine.cache.device_memory as memory

    monkeypatch.setattr(memory, "device_free_bytes", lambda device: 2 * 2**20)
    # The CPU device's slots are the host copy and need no memory (that cache loads); with the device's
    # kernels (Triton's interpreter here) its slots hold copies, as a device's do.
    load_model(model, n_ctx=64, cache=CacheSettings(mib=3.0)).close()
    with pytest.raises(CacheError, match=r"has 2 MiB free") as info:
        load_model(model, n_ctx=64, cache=CacheSettings(mib=3.0, device_kernels="triton"))
    assert info.value.parameter == "mib" and info.value.suggestion is not None
    proposed = int(info.value.suggestion)
    load_model(model, n_ctx=64, cache=CacheSettings(mib=proposed, device_kernels="triton")).close()  # it fits
    from moechat.app.settings import error_line

    # The command line names its own flag, and the value to try.
    line = error_line(info.value)
    assert "--moe-cache-mib: a cache of 3 MiB" in line and f"try --moe-cache-mib {proposed}" in line


@pytest.mark.slow
def test_full_context_drops_the_oldest_turns(model: Path) -> None:
    engine = _engine(model, n_ctx=96)
    chat = [{"role": "system", "content": "Be brief."}]
    for i in range(12):
        chat.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i} about rivers"})
    prompt, dropped, _ = engine.fit_messages(chat)
    assert dropped > 0 and len(prompt) < 96
    events = list(engine.reply(prompt, GREEDY, 200, threading.Event()))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.n_prompt + done.n_generated <= 96
    huge = [{"role": "user", "content": "flood " * 500}]
    prompt, _, _ = engine.fit_messages(huge)
    assert 0 < len(prompt) <= 96
    assert isinstance(list(engine.reply(prompt, GREEDY, 8, threading.Event()))[-1], DoneEvent)
    engine.close()


def test_failed_saves_keep_the_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moechat.app.atomic as atomic
    from moechat.app.conversations import Conversation, ConversationStore
    from moechat.app.export import write_stats

    store = ConversationStore(tmp_path / "conv")
    conv = Conversation(messages=[{"role": "user", "content": "first"}])
    path = store.save(conv)
    before = path.read_bytes()
    real_replace = atomic.os.replace

    def full_disk(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", full_disk)
    conv.messages.append({"role": "assistant", "content": "second"})
    with pytest.raises(OSError, match="No space"):
        store.save(conv)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    out = tmp_path / "stats.json"
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    write_stats({"schema_version": 1, "layers": []}, out, "json")
    old = out.read_text()
    monkeypatch.setattr(atomic.os, "replace", full_disk)
    with pytest.raises(OSError):
        write_stats({"schema_version": 1, "layers": [1]}, out, "json")
    assert out.read_text() == old


def test_corrupt_conversations_are_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from moechat.app.conversations import Conversation, ConversationStore

    store = ConversationStore(tmp_path / "conv")
    good = store.save(Conversation(messages=[{"role": "user", "content": "ok"}]))
    (tmp_path / "conv" / "broken.json").write_text('{"id": "broken", "messages": [')
    (tmp_path / "conv" / "odd.json").write_text(json.dumps({"id": "odd", "messages": [{"x": 1}]}))
    listed = store.list()
    assert [c.id for c in listed] == [good.stem]
    aside = sorted(p.name for p in (tmp_path / "conv" / "corrupt").iterdir())
    assert aside == ["broken.json", "odd.json"]  # kept, not deleted or overwritten
    assert "could not be read" in caplog.text
