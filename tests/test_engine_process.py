"""The shipped app's engine process: the real engine behind a pipe, streaming, stopping, errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from moechat.app.settings import Settings
from moechat.app.tui import MoechatApp
from moechat.widgets.layer_stats import LayerStats
from testkit.ggufgen import tiny_moe
from testkit.pilot import ready, say


@pytest.mark.slow
def test_the_shipped_app_chats_through_its_engine_process(tmp_path: Path) -> None:
    """The app as `moechat` runs it: real_engine_factory starts the engine process (a real model,
    its expert cache); the chat screen streams a reply from it and shows the cache's counters."""
    from moechat.app.paths import AppPaths
    from moechat.app.tui import real_engine_factory
    from moechat.engine.loader import load_model

    path = tiny_moe(tmp_path / "m.gguf", n_expert=8, n_expert_used=2)
    load_model(path, n_ctx=256).close()  # its kernels compile here, into numba's disk cache
    settings = Settings(n_predict=12, temp=0.0, ctx_size=256, device="cpu", moe_cache_mib=1.5, threads=1)
    paths = AppPaths(tmp_path / "config", tmp_path / "data", tmp_path / "cache", tmp_path / "log")
    app = MoechatApp(real_engine_factory(str(path), settings, tmp_path / "warm"), settings, paths=paths)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await ready(pilot, timeout=120)  # a fresh interpreter imports torch and loads the model
            await say(pilot, screen, "Hello")
            assert screen.conv.messages[-1]["role"] == "assistant" and screen.conv.messages[-1]["content"]
            snap = screen.query_one(LayerStats).snapshot
            assert snap is not None and snap.total.hits > 0 and app.engine.info.name == "m.gguf"

    asyncio.run(run())
    assert list((tmp_path / "warm").glob("*.json"))  # the engine process saved the use counts at exit


@pytest.mark.slow
def test_process_engine_streams_stops_and_reports_errors(tmp_path: Path) -> None:
    import threading

    from moechat.app.engine_process import EngineSpec, ProcessEngine
    from moechat.engine.events import DoneEvent, SamplingParams, TokenEvent

    path = tiny_moe(tmp_path / "m.gguf")
    progress: list[str] = []
    engine = ProcessEngine(
        EngineSpec(
            str(path), Settings(ctx_size=256, device="cpu", moe_cache_mib=1.0, moe_cache_cpu_share=0.5, threads=1)
        ),
        progress.append,
    )
    try:
        assert engine.info.name == "m.gguf" and any("loading" in p for p in progress)
        assert engine.info.hardware.endswith(", 1 threads")  # --threads reaches the engine process
        prompt, dropped, note = engine.fit_messages([{"role": "user", "content": "Hello"}])
        assert prompt and dropped == 0 and note == ""
        events = list(engine.reply(prompt, SamplingParams(temperature=0.0), 12, threading.Event()))
        assert isinstance(events[-1], DoneEvent) and events[-1].n_generated == 12
        snap = engine.snapshot()
        assert snap is not None and snap.total.lookups > 0 and snap.cpu_share == 0.5
        stop = threading.Event()
        n = 0
        for ev in engine.reply(prompt, SamplingParams(temperature=0.0), 200, stop):
            if isinstance(ev, TokenEvent):
                n += 1
                if n == 3:
                    stop.set()
            elif isinstance(ev, DoneEvent):
                # stopped, well before its 200: how many tokens it made after the third depends on the load
                assert ev.stop_reason == "stopped" and ev.n_generated < 200
        engine.set_cache(2.0, 0.0)
        assert engine.cache() == (2.0, 0.0)
        with pytest.raises(ValueError, match="cpu-share"):
            engine.set_cache(1.0, 3.0)
        assert engine.cache() == (2.0, 0.0)  # a refused change keeps the cache it had
    finally:
        engine.close()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(10))
    with pytest.raises(ValueError, match="bad.gguf"):
        ProcessEngine(EngineSpec(str(bad), Settings(ctx_size=256, device="cpu")))
