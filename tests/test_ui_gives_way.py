"""The chat app's UI gives the engine its cores: its threads drop in priority once the engine runs,
every engine starts at the original priority, the engine's thread governor counts the UI's CPU time
as its own, and a stop reaches the engine without waiting for its next message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from moechat.app.engine_process import UI_NICE, ProcessEngine
from moechat.engine.kernels import threads
from testkit.ggufgen import tiny_moe

PRIORITIES = """
import json, os, sys
from moechat.app.engine_process import EngineSpec, ProcessEngine
from moechat.app.settings import Settings
spec = EngineSpec(sys.argv[1], Settings(threads=1))
before = os.getpriority(os.PRIO_PROCESS, 0)
first = ProcessEngine(spec)
ui = os.getpriority(os.PRIO_PROCESS, 0)
second = ProcessEngine(spec)  # started after the UI lowered itself
out = {"before": before, "ui": ui, "first": os.getpriority(os.PRIO_PROCESS, first._proc.pid),
       "second": os.getpriority(os.PRIO_PROCESS, second._proc.pid)}
first.close(); second.close()
print(json.dumps(out))
"""


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no process priorities here")
def test_the_ui_lowers_itself_once_the_engine_runs_and_every_engine_keeps_the_original_priority(
    tmp_path: Path,
) -> None:
    path = tiny_moe(tmp_path / "m.gguf")
    # In a process of its own: the lowered priority stays with the process that lowered it.
    r = subprocess.run([sys.executable, "-c", PRIORITIES, str(path)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ui"] == max(got["before"], UI_NICE), got
    assert got["first"] == got["second"] == got["before"], got


def test_the_governor_counts_a_yielding_process_cpu_as_its_own() -> None:
    """A process that runs below the engine's priority takes no kernel thread away: its CPU time is the
    engine's own in the governor's look."""
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.4: pass\nprint(1, flush=True)\ntime.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert busy.stdout is not None and busy.stdout.readline().strip() == "1"  # its 0.4 s are spent
        watch = threads.CoreWatch()
        tick = watch.tick
        child = threads._cpu_seconds(busy.pid, tick)
        assert child >= 0.35
        mine = watch._read()
        assert mine is not None
        threads.yielding_to_us(busy.pid)
        try:
            counted = watch._read()
            assert counted is not None
            assert counted[2] - mine[2] >= child - 0.02  # its CPU now counts as ours
        finally:
            threads._yielding.discard(busy.pid)
    finally:
        busy.kill()
        busy.wait()
    assert threads._cpu_seconds(busy.pid, tick) == 0.0  # a process that is gone counts nothing


def test_a_stop_reaches_the_engine_before_its_next_message() -> None:
    """A sweep between two runs, or its replay, sends nothing for seconds: the stop must not wait for it."""
    import multiprocessing as mp

    parent, child = mp.Pipe()
    engine = ProcessEngine.__new__(ProcessEngine)  # the pipe's parent side, with the test as the engine
    engine._conn, engine._stop, engine._lock = parent, threading.Event(), threading.Lock()
    stop = threading.Event()
    got: list[object] = []

    def read() -> None:
        for ev in engine._stream("sweep", (), stop):
            got.append(ev)

    reader = threading.Thread(target=read)
    reader.start()
    assert child.recv() == ("sweep", ())
    child.send(("event", "first"))
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == ["first"]  # the reader waits for the engine's next message now
    stop.set()  # the user cancels; the engine says nothing more until it sees the stop
    deadline = time.monotonic() + 60
    while not engine._stop.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine._stop.is_set()
    child.send(("end", None))
    reader.join(10)
    assert not reader.is_alive() and got == ["first"]
