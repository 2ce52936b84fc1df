"""Reading stretches of a model file into memory of our own, past the page cache, several at once.

The RAM tier (cache.ram_tier) fills its slots from the file: an expert's gate, up and down slices
are each one contiguous stretch. Reads go around the page cache (O_DIRECT), so the bytes sit in
RAM once, in the slot, not a second time in the kernel's cache; direct reads want their offset,
length and buffer aligned to the device's blocks, so each one reads the aligned stretch around
the wanted bytes into a page-aligned buffer of its thread and copies the wanted part out. A
stretch longer than `CHUNK` is read in several pieces, each its own request in flight: the disks
this is for read about four times faster at 4 MiB than at 64 KiB one at a time, and faster again
with several requests queued.

A file system that refuses direct I/O (tmpfs, some network mounts) gets buffered reads that then
tell the kernel to drop what they read (POSIX_FADV_DONTNEED), said once in the log.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

ALIGN = 4096  # direct I/O's alignment: a page, which every block size we meet divides
CHUNK = 4 << 20  # bytes per request: the size at which the disks measured reach their bandwidth
READERS = 8  # requests in flight


class ReadError(OSError):
    """A stretch that could not be read whole; the message names the file and what the bytes are."""


class DirectReader:
    """Reads (shard, offset, length) stretches of a model's files into arrays, on `READERS` threads."""

    def __init__(self, paths: Sequence[Path], readers: int = READERS, direct: bool = True) -> None:
        self.paths = list(paths)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._fds: list[int] = []
        self._retired: list[int] = []
        self._sizes: list[int] = []
        for p in self.paths:
            self._fds.append(self._open(p))
            self._sizes.append(os.fstat(self._fds[-1]).st_size)
        self._local = threading.local()
        # Reads a lookup waits for and reads ahead of one queue apart: a demand read never waits behind
        # the look-ahead's.
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix="moechat-read")
        self._ahead_pool = ThreadPoolExecutor(readers, thread_name_prefix="moechat-read-ahead")
        self.bytes_read = 0  # bytes asked for (not counting the alignment around them)
        self._lock = threading.Lock()

    def _open(self, path: Path) -> int:
        if self.direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:  # EINVAL: the file system has no direct I/O
                self._buffered(path, e)
        return os.open(path, os.O_RDONLY)

    def _buffered(self, path: Path, e: OSError) -> None:
        self.direct = False
        logger.warning("%s: no direct reads on this file system (%s): buffered reads, dropped from the page cache "
                       "after use", path, e.strerror)  # fmt: skip

    def _fall_back(self, shard: int, e: OSError) -> None:
        """A file system that took O_DIRECT at open but refuses the reads: every file reopened buffered."""
        with self._lock:
            if not self.direct:
                return
            self._buffered(self.paths[shard], e)
            # The direct descriptors stay open until close: a read on another thread may hold one now.
            self._retired += self._fds
            self._fds = [os.open(p, os.O_RDONLY) for p in self.paths]

    def _buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            # An anonymous map is page-aligned, as direct reads want.
            buf = self._local.buf = mmap.mmap(-1, CHUNK + 2 * ALIGN)
        return memoryview(buf)

    def read(self, shard: int, offset: int, dest: np.ndarray, what: str = "") -> None:
        """Fill `dest` (a C-contiguous uint8 array) with the file's bytes at `offset`, here and now.

        Raises ReadError naming the file and `what` on a short read or an I/O error."""
        direct = self.direct
        try:
            self._read(shard, offset, dest, what)
        except ReadError:
            raise
        except OSError as e:
            if e.errno != errno.EINVAL or not direct:
                raise ReadError(f"{self.paths[shard]}: {what}: read error at offset {offset}: {e.strerror}") from None
            self._fall_back(shard, e)  # (another thread's read may have fallen back first)
            self._read(shard, offset, dest, what)
        with self._lock:
            self.bytes_read += dest.nbytes

    def _read(self, shard: int, offset: int, dest: np.ndarray, what: str) -> None:
        direct = self.direct
        fd, size, n = self._fds[shard], self._sizes[shard], dest.nbytes
        out = dest.reshape(-1)
        if offset < 0 or offset + n > size:
            raise ReadError(
                f"{self.paths[shard]}: {what}: {n} bytes at offset {offset} run past the file's end ({size})"
            )
        buf = self._buffer()
        done = 0
        while done < n:
            want = min(CHUNK, n - done)
            at = offset + done
            start = at // ALIGN * ALIGN if direct else at
            end = -(-(at + want) // ALIGN) * ALIGN if direct else at + want
            got = os.preadv(fd, [buf[: end - start]], start)
            if got < at + want - start:  # a direct read may stop at the file's end, past what we want
                raise ReadError(f"{self.paths[shard]}: {what}: short read at offset {at} ({got} of "
                                f"{end - start} bytes)")  # fmt: skip
            out[done : done + want] = np.frombuffer(buf, np.uint8, want, at - start)
            done += want
        if not direct:
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)

    def submit(self, shard: int, offset: int, dest: np.ndarray, what: str = "",
               ahead: bool = False) -> list[Future[None]]:  # fmt: skip
        """`read` on the reader threads, split into `CHUNK` pieces each in flight on its own; `ahead`: on the
        look-ahead's threads."""
        flat = dest.reshape(-1)
        n = flat.nbytes
        pool = self._ahead_pool if ahead else self._pool
        return [pool.submit(self.read, shard, offset + a, flat[a : min(a + CHUNK, n)], what)
                for a in range(0, n, CHUNK)]  # fmt: skip

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._ahead_pool.shutdown(wait=True)
        for fd in self._fds + self._retired:
            os.close(fd)
        self._fds, self._retired = [], []
