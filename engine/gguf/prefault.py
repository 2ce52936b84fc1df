"""The file map's pages mapped into the process ahead of use, in the background.

A new process that maps a model finds its pages in the page cache but not in its own page tables:
every first touch during decode is a page fault, spread over the first tokens (llama.cpp populates
its map at load for the same reason). `Prefault` asks the kernel to map every page of the file,
readable, in chunks on a background thread (MADV_POPULATE_READ, Linux 5.14+): no byte is copied and
no page is duplicated (a read never breaks the private map's copy-on-write), so the resident memory
stays at most the file's size. Reads from disk, for a file not yet cached, happen there too. Where
the call is not known (older kernels, other systems) it stops at the first chunk and nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time

logger = logging.getLogger(__name__)

MADV_POPULATE_READ = 22
CHUNK = 16 << 20  # bytes per call: a stop request waits for one chunk at most


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):  # the advice's number means this on Linux only
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    f.restype = ctypes.c_int
    return f


def _address(m: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(m)  # a writable (private) map; the export ends with `view`
    try:
        return ctypes.addressof(view)
    finally:
        del view


class Prefault:
    """Maps the pages of `maps` on a thread; `close()` stops it (within one chunk) and waits for it."""

    def __init__(self, maps: list[mmap.mmap], name: str, spans: list[list[tuple[int, int]]] | None = None) -> None:
        """`spans`: per map, the (offset, length) stretches to map (None: every page of every map)."""
        self.name = name
        self.done = threading.Event()
        self.seconds = 0.0
        self.bytes = 0
        self._stop = threading.Event()
        regions = []
        page = mmap.PAGESIZE
        for i, m in enumerate(maps):
            try:
                base = _address(m)
            except (TypeError, ValueError, BufferError) as e:  # a read-only or closed map: read as used
                logger.debug("%s: pages not mapped ahead (%s)", name, e)
                continue
            for off, n in spans[i] if spans is not None else [(0, len(m))]:
                start = off // page * page  # madvise takes whole pages
                regions.append((base + start, min(len(m), off + n) - start))
        self._thread = threading.Thread(target=self._run, args=(regions,), name="moechat-prefault", daemon=True)
        self._thread.start()

    def _run(self, regions: list[tuple[int, int]]) -> None:
        madvise = _madvise()
        t = time.perf_counter()
        try:
            if madvise is None:
                return
            for addr, size in regions:
                for off in range(0, size, CHUNK):
                    if self._stop.is_set():
                        return
                    n = min(CHUNK, size - off)
                    if madvise(addr + off, n, MADV_POPULATE_READ) != 0:
                        err = ctypes.get_errno()
                        logger.debug("%s: pages not mapped ahead (%s)", self.name, os.strerror(err))
                        return
                    self.bytes += n
            self.seconds = time.perf_counter() - t
            logger.info("%s: %.0f MiB of pages mapped ahead in %.2f s", self.name, self.bytes / 2**20, self.seconds)
        finally:
            self.done.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
