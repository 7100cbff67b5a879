"""Start writing received bytes to disk while more arrive, so the fsync at the end is short.

A blob on a node and a gathered file are fsynced before anyone is told they exist. The
page cache otherwise holds every dirty byte until that fsync, which then writes them all
while the CPU that received them sits idle: on the loopback bench a third of a gather's
time was its final fsync. Asking the kernel, every WRITEBACK_CHUNK_BYTES, to begin
writing the range just written (Linux sync_file_range with SYNC_FILE_RANGE_WRITE: it
starts the I/O and returns, it waits for nothing and makes nothing durable) overlaps the
disk with the network and the hashing. The fsync stays where it was, so durability is
exactly what it was; where the call does not exist (macOS, BSD) this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable

from smoltorrent import defaults

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def _load() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None  # a libc without it: the fsync alone does the writing, as before
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_sync_file_range = _load()


def start(fd: int, offset: int, length: int) -> bool:
    """Begin writing bytes [offset, offset + length) of fd to disk; whether the kernel took
    the request. Never raises: a file system or fd that refuses only loses the overlap."""
    if _sync_file_range is None or length <= 0:
        return False
    return _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE) == 0


class Trail:
    """Follows one sequential run of writes to fd from `offset` and starts the writeback of
    each WRITEBACK_CHUNK_BYTES behind it as the run grows."""

    def __init__(
        self, fd: int, offset: int = 0, chunk: int = defaults.WRITEBACK_CHUNK_BYTES
    ) -> None:
        self._fd = fd
        self._started = offset  # everything before this has been handed to writeback
        self._chunk = chunk

    def wrote(self, end: int) -> None:
        """The run now reaches file offset `end` (exclusive)."""
        if end - self._started >= self._chunk:
            start(self._fd, self._started, end - self._started)
            self._started = end


class Scattered:
    """Counts the bytes several threads write anywhere in fd (a chunked gather's chunks,
    a few MB each, land out of order: no one run grows by WRITEBACK_CHUNK_BYTES) and, each
    time that many more were written, starts the writeback of the whole file: the kernel
    takes what is dirty of it, in file order. Thread-safe."""

    def __init__(self, fd: int, chunk: int = defaults.WRITEBACK_CHUNK_BYTES) -> None:
        self._fd = fd
        self._chunk = chunk
        self._pending = 0  # bytes written since the last start
        self._lock = threading.Lock()

    def wrote(self, n: int) -> None:
        with self._lock:
            self._pending += n
            if self._pending < self._chunk:
                return
            self._pending = 0
        start_all(self._fd)


def start_all(fd: int) -> bool:
    """Begin writing every dirty byte of fd to disk; whether the kernel took the request."""
    if _sync_file_range is None:
        return False
    return _sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE) == 0  # 0 bytes: to the end


def supported() -> bool:
    """Whether this platform starts writeback early (tests and the bench report it)."""
    return _sync_file_range is not None
