"""The default thread count gives way to other processes: measured on this machine's own cores."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from moechat.engine.kernels import threads
from moechat.engine.kernels.threads import LOOK_EVERY_S, CoreWatch, ThreadGovernor
from moechat.engine.loader import set_threads

linux_only = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat")


def _spinner() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@linux_only
def test_the_watch_sees_another_process_keep_a_core_busy() -> None:
    watch = CoreWatch()
    spin = _spinner()
    try:
        time.sleep(0.2)
        watch.others()  # from here on the spinner runs the whole interval
        t = time.process_time()
        while time.process_time() - t < 0.5:  # this process busy too: its own time is not counted as others'
            pass
        busy = watch.others()
    finally:
        spin.kill()
        spin.wait()
    assert busy is not None and busy >= 0.6, busy
    assert busy <= len(watch.cpus) + 0.1


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_governor_takes_a_thread_away_while_a_core_is_busy() -> None:
    n_cores = len(os.sched_getaffinity(0))
    changes: list[int] = []
    governor = ThreadGovernor(n_cores, on_change=changes.append)
    try:
        assert governor.pace() == n_cores and changes == [n_cores]  # applied to this thread at once
        spin = _spinner()
        try:
            time.sleep(0.2)
            deadline = time.monotonic() + 20 * LOOK_EVERY_S
            while governor.pace() == n_cores and time.monotonic() < deadline:
                time.sleep(LOOK_EVERY_S / 5)
        finally:
            spin.kill()
            spin.wait()
        assert governor.n < n_cores and governor.busy_elsewhere >= 0.5
        assert changes[-1] == governor.n
    finally:
        governor.close()


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_reply_that_starts_beside_a_busy_core_starts_with_fewer_threads() -> None:
    """The watcher looks while the engine waits, so the first step of a reply (a short prompt is often
    one step, over in a fraction of a second) already runs on the cores others leave."""
    n_cores = len(os.sched_getaffinity(0))
    governor = ThreadGovernor(n_cores)
    spin = _spinner()
    try:
        time.sleep(8 * LOOK_EVERY_S)  # the engine idle: no step, no pace()
        first = governor.pace()
    finally:
        spin.kill()
        spin.wait()
        governor.close()
    assert first < n_cores, governor.busy_elsewhere


def test_only_the_default_thread_count_is_governed() -> None:
    try:
        set_threads(1)
        assert threads.pace() is None  # a count the user set is kept as set
        set_threads(0)
        assert threads.pace() is not None
    finally:
        set_threads(0)


def test_a_thread_is_taken_at_once_and_given_back_after_two_quiet_looks(tmp_path: Path) -> None:
    """The governor's rule on a recorded /proc/stat (the kernel's format, written here): one look that
    sees a core busy takes a thread; a single quiet look between two busy ones gives nothing back."""
    stat = tmp_path / "stat"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    busy_ticks = [0] * len(cpus)
    idle_ticks = [0] * len(cpus)

    def write(busy_cores: int) -> None:  # 0.25 s (25 ticks at 100 Hz) more, `busy_cores` of them busy
        for i in range(len(cpus)):
            if i < busy_cores:
                busy_ticks[i] += 25
            else:
                idle_ticks[i] += 25
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        lines += [f"cpu{c} {busy_ticks[i]} 0 0 {idle_ticks[i]} 0 0 0 0 0 0" for i, c in enumerate(cpus)]
        stat.write_text("\n".join(lines) + "\n")

    write(0)
    governor = ThreadGovernor(len(cpus), CoreWatch(str(stat)), start=False)
    if os.sysconf("SC_CLK_TCK") != 100:
        pytest.skip("the recorded ticks assume 100 Hz")
    seen = []
    for busy in (1, 0, 1, 0, 0):
        write(busy)
        governor.look()
        seen.append(governor.pace())
    full = len(cpus)
    assert seen == [full - 1, full - 1, full - 1, full - 1, full]


def test_every_core_busy_leaves_one_thread_and_the_cores_come_back_after_two_quiet_looks(tmp_path: Path) -> None:
    """Another process on every core while this one waits (the watcher looks all the while): the next
    reply starts on one thread; the cores come back two quiet looks after the other process stops."""
    stat = tmp_path / "stat"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
    if len(cpus) < 2 or os.sysconf("SC_CLK_TCK") != 100:
        pytest.skip("needs two cores and 100 Hz ticks")
    ticks = {"busy": 0, "idle": 0}

    def write(busy: bool) -> None:  # 0.25 s more, every core busy or idle
        ticks["busy" if busy else "idle"] += 25
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"] + [f"cpu{c} {ticks['busy']} 0 0 {ticks['idle']} 0 0 0 0 0 0" for c in cpus]
        stat.write_text("\n".join(lines) + "\n")

    write(False)
    governor = ThreadGovernor(len(cpus), CoreWatch(str(stat)), start=False)
    seen = []
    for busy in (True, True, False, False, True):
        write(busy)
        seen.append(governor.look())
    assert seen == [1, 1, 1, len(cpus), 1]
    assert governor.pace() == 1
