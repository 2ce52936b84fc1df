"""How many threads the kernels may use now: fewer while other processes keep cores busy.

The parallel kernels split each call evenly over their threads and wait for the last one. When
another process takes a core, one of the threads waits for the scheduler (milliseconds) at every
call, hundreds of calls per token: decode then runs slower on two threads than on one. So with the
default thread count (`-t 0`) a `ThreadGovernor` looks, four times a second from a thread of its own,
at how many of this process's cores other processes (and the hypervisor's steal) used since its last
look, and runs the kernels and torch's ops on the cores left. A count the user set is kept as set.

The look reads /proc/stat (the cores this process may run on) and the process's own CPU time; where
there is no /proc/stat the count stays at its maximum. Processes named by `yielding_to_us` (the chat
app's UI, which lowers its own priority so that it draws in the engine's gaps) count as this one's:
their CPU time takes no thread away.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from .jit import set_kernel_threads

logger = logging.getLogger(__name__)

LOOK_EVERY_S = 0.25
# Others' use, in cores, that takes a thread away: above half a core, a thread would share its core.
TAKE_AT = 0.5
UP_AFTER = 2  # looks in a row that find a core free before a thread is given back


_yielding: set[int] = set()  # pids whose CPU time counts as this process's own (they give way to it)


def yielding_to_us(pid: int) -> None:
    """Count `pid`'s CPU time as this process's own: a process that runs at a lower priority than the
    engine takes a core only where the engine leaves one idle, so the engine keeps its threads."""
    _yielding.add(pid)


def _cpu_seconds(pid: int, tick: int) -> float:
    """User + system CPU seconds of process `pid` (0 where it cannot be read: gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / tick  # utime, stime: the 14th and 15th fields


class CoreWatch:
    """The cores other processes kept busy between two looks, on the cores this process may use."""

    def __init__(self, stat: str = "/proc/stat") -> None:
        self.stat = stat
        try:
            self.cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
        except AttributeError:  # not Linux
            self.cpus = set()
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        """(busy seconds of our cores, their total seconds, this process's CPU seconds)."""
        try:
            with open(self.stat, "rb") as f:
                text = f.read().decode()
        except OSError:
            return None
        busy = total = 0.0
        for line in text.splitlines():
            name, _, rest = line.partition(" ")
            if name not in self.cpus:
                continue
            fields = [int(v) for v in rest.split()]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
            # guest time is already inside user time
            all_ = sum(fields[:8])
            busy += all_ - idle
            total += all_
        if total == 0:
            return None
        t = os.times()
        ours = t.user + t.system + sum(_cpu_seconds(pid, self.tick) for pid in _yielding)
        return busy / self.tick, total / self.tick, ours

    def others(self) -> float | None:
        """Cores kept busy by anything but this process since the last call (None: unknown)."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[1] - last[1] <= 0:
            return None
        wall = (now[1] - last[1]) / max(1, len(self.cpus))  # seconds that passed
        return max(0.0, (now[0] - last[0]) - (now[2] - last[2])) / wall


class ThreadGovernor:
    """The kernels' thread count for the calling thread: at most `n_max`, one fewer per core others keep busy.

    A watcher thread looks at the cores every `every_s`, all the time (while the engine waits too), so the
    first step of a reply already runs with a count that fits what others do now: a prompt is often over
    before a look made on the decode path would have happened, and two threads that share a core with
    another process run it 5-30x slower. `pace()` only applies the latest count to the calling thread
    (numba's count is per thread); call it before each step, and between a prompt's layers.
    `on_change(n)` runs, on the calling thread, when the count it applies changes (torch's threads follow
    the kernels'). `start=False` leaves out the watcher (tests call `look()` themselves).
    """

    def __init__(
        self,
        n_max: int,
        watch: CoreWatch | None = None,
        on_change: Callable[[int], None] | None = None,
        every_s: float = LOOK_EVERY_S,
        start: bool = True,
    ) -> None:
        self.n_max = max(1, n_max)
        self.watch = watch or CoreWatch()
        self.on_change = on_change
        self.every_s = every_s
        self.n = self.n_max
        self.busy_elsewhere = 0.0
        self._up_votes = 0
        self._applied = threading.local()
        self._stop = threading.Event()
        if start:
            threading.Thread(target=self._run, name="moechat-thread-governor", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.look()

    def close(self) -> None:
        """Stop the watcher (the count stays as it was)."""
        self._stop.set()

    def look(self) -> int:
        """One look at what other processes did since the previous one; returns the count it leaves."""
        others = self.watch.others()
        if others is None:
            return self.n
        self.busy_elsewhere = others
        n = max(1, min(self.n_max, len(self.watch.cpus) - int(others + (1 - TAKE_AT))))
        # A thread is taken away at once, given back only after two looks agree: a core that looked free
        # for one look (the other process between two bursts) costs a collapse.
        self._up_votes = self._up_votes + 1 if n > self.n else 0
        if n < self.n or (n > self.n and self._up_votes >= UP_AFTER):
            logger.info("other processes keep %.1f cores busy: %d kernel threads", others, n)
            self.n = n
            self._up_votes = 0
        return self.n

    def pace(self) -> int:
        """The thread count to run the next step with, applied to the calling thread."""
        n = self.n
        if getattr(self._applied, "n", None) != n:
            self._applied.n = n
            set_kernel_threads(n)
            if self.on_change is not None:
                self.on_change(n)
        return n


_governor: ThreadGovernor | None = None


def govern(governor: ThreadGovernor | None) -> None:
    """Set (or, with None, remove) the process's governor: the default thread count has one, a set count none."""
    global _governor
    if _governor is not None and _governor is not governor:
        _governor.close()
    _governor = governor


def pace() -> int | None:
    """The governor's count for the next step on the calling thread, applied; None without a governor."""
    g = _governor
    return g.pace() if g is not None else None
