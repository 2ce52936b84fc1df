"""A first start answers at once from the exact path while a helper compiles the kernels; the fast model
takes over between replies once they are compiled (engine/models/first_start.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from moechat.app.real_engine import RealEngine
from moechat.engine.cache.settings import CacheSettings
from moechat.engine.events import SamplingParams, TokenEvent
from moechat.engine.generate import Model, generate
from moechat.engine.loader import LoadedModel, load_model
from moechat.engine.models import compile_ahead
from moechat.engine.models.first_start import EagerModel
from moechat.engine.models.opening import open_model
from moechat.engine.moe import routing
from moechat.engine.nn import layers
from testkit.ggufgen import Q, tiny_moe

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the helper compiles on a second core")


def first_model(folder: Path) -> Path:
    """A small MoE of a kind no other test loads: any load stamps its kind compiled (`loader.load_model`), and the
    suite's workers load models beside these tests."""
    return tiny_moe(folder / "m.gguf", expert_type=Q.Q5_1)


def never_compiled(path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The model's kind with its compiled stamp removed (the suite's kernels stay in numba's disk cache, so
    the helper's passes load rather than compile them): a load takes it for a first start."""
    monkeypatch.setenv("MOECHAT_COMPILE_AHEAD", "1")
    gguf, cfg = open_model(path)
    try:
        kind = compile_ahead.kind(gguf, cfg, "fast")
    finally:
        gguf.close()
    stamp = compile_ahead._stamp(kind)
    # A helper an earlier test started outlives it (as it outlives a short run) and stamps the kind when through:
    # wait for it, or its stamp would land after this one is removed.
    with compile_ahead.compiling_lock(kind, wait=True):
        if stamp is not None:
            stamp.unlink(missing_ok=True)
    return kind


def greedy(model: Model, lm: LoadedModel, n: int = 8) -> list[int]:
    events = generate(model, lm.tokenizer, [1, 5, 9, 13], lm.new_cache(), max_tokens=n,
                      params=SamplingParams(temperature=0.0), stop=threading.Event())  # fmt: skip
    return [e.token for e in events if isinstance(e, TokenEvent)]


def no_compiled_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a compiled few-row op ran on the exact path of a first start")

    for module, name in ((layers, "decode_attention"), (layers, "rms_rows"), (routing, "route_rows")):
        monkeypatch.setattr(module, name, refuse)


def test_a_first_start_answers_from_the_exact_path_then_hands_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = first_model(tmp_path)
    kind = never_compiled(path, monkeypatch)
    lm = load_model(path, n_ctx=64, first_start=True)
    fs = lm.first_start
    assert fs is not None and fs.helper is not None
    assert (lm.cpu_kernels, lm.cache) == ("exact", None)  # the exact path, no expert cache
    with monkeypatch.context() as m:
        no_compiled_calls(m)
        interim = greedy(EagerModel(lm.model), lm)
    # The same tokens as the exact kernels' own load (its few-row ops compiled).
    exact = load_model(path, n_ctx=64, cpu_kernels="exact")
    try:
        assert interim == greedy(exact.model, exact)
    finally:
        exact.close()
    fast = fs.take(wait=True)
    assert fast is not None and fast.cpu_kernels == "fast"
    assert fs.helper.returncode == 0 and compile_ahead.compiled(kind)  # the helper ran to the end and stamped it
    assert len(greedy(fast.model, fast)) == 8
    assert fs.take() is None  # once only: the caller owns it
    lm.close()
    fast.close()
    assert load_model(path, n_ctx=64, first_start=True).first_start is None  # compiled: no exact path now


def test_a_second_start_beside_a_compiling_helper_starts_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another start's helper holds the kind's lock: this start serves from the exact path too, starts no
    helper of its own, and loads the fast model once the lock is free."""
    path = first_model(tmp_path)
    kind = never_compiled(path, monkeypatch)
    with compile_ahead.compiling_lock(kind, wait=False) as taken:
        assert taken
        lm = load_model(path, n_ctx=64, first_start=True)
        fs = lm.first_start
        assert fs is not None and fs.helper is None and fs.compiling()
        fs.begin_upgrade()
        time.sleep(0.5)
        assert not fs.ready()  # waits for the other helper
    fast = fs.take(wait=True)
    assert fast is not None and fast.cpu_kernels == "fast"
    lm.close()
    fast.close()


def test_the_chat_engine_swaps_in_the_fast_model_between_replies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply before the kernels are compiled runs on the exact path; the reply after takes the fast model,
    with the cache the user set meanwhile, and the conversation goes on."""
    path = first_model(tmp_path)
    never_compiled(path, monkeypatch)
    threads = torch.get_num_threads()
    engine = RealEngine(load_model(path, n_ctx=128, first_start=True), CacheSettings())
    try:
        fs = engine.lm.first_start
        assert fs is not None and engine.lm.cpu_kernels == "exact"
        assert "first start" in engine.info.cache_note
        engine.set_cache(1.0, 0.5)  # no cache on the exact path: kept for the fast model
        assert engine.cache() == (1.0, 0.5) and engine.lm.cache is None
        params = SamplingParams(temperature=0.0)
        first = [e for e in engine.reply([1, 5, 9], params, 4, threading.Event()) if isinstance(e, TokenEvent)]
        assert len(first) == 4 and engine.lm.cpu_kernels == "exact"
        deadline = time.monotonic() + 300
        while not fs.ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fs.ready() and fs.error is None
        prompt = [1, 5, 9, *(e.token for e in first), 7]
        second = [e for e in engine.reply(prompt, params, 4, threading.Event()) if isinstance(e, TokenEvent)]
        assert len(second) == 4
        assert engine.lm.cpu_kernels == "fast" and engine.lm.first_start is None
        assert engine.lm.cache is not None and engine.cache() == (1.0, 0.5)
        assert engine.info.cache_note == ""
        assert torch.get_num_threads() == threads  # the core the helper had is the engine's again
    finally:
        engine.close()


@pytest.mark.slow
def test_the_app_shows_the_fast_kernels_taking_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped app on a first start: its first reply comes from the exact path with the info line saying
    so; once the helper is through, a later reply brings the cache the settings ask for onto the info line."""
    import asyncio

    from moechat.app.paths import AppPaths
    from moechat.app.settings import Settings
    from moechat.app.tui import MoechatApp, real_engine_factory
    from testkit.pilot import ready, say, until

    path = first_model(tmp_path)
    kind = never_compiled(path, monkeypatch)  # the engine process inherits the environment
    settings = Settings(n_predict=4, temp=0.0, ctx_size=256, device="cpu", moe_cache_mib=1.5, threads=1)
    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    app = MoechatApp(real_engine_factory(str(path), settings, tmp_path / "warm"), settings, paths=paths)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot, timeout=120)
            assert "first start" in app.engine.info.cache_note and app.cache_in_effect == (0.0, 0.0)
            await say(pilot, screen, "Hello")
            assert screen.conv.messages[-1]["content"]
            await until(pilot, lambda: compile_ahead.compiled(kind), timeout=300)  # the helper stamped it
            for n in range(20):  # the engine loads the fast model in a thread after the helper: a few seconds
                await say(pilot, screen, f"And {n}?")
                if "first start" not in app.engine.info.cache_note:
                    break
                await asyncio.sleep(1.0)
            assert "first start" not in app.engine.info.cache_note
            assert app.cache_in_effect[0] == 1.5 and "first start" not in str(screen.query_one("#info").render())

    asyncio.run(run())
