"""An event a signal handler may set.

Python runs a signal handler in the main thread, between two of its bytecodes. A
`threading.Event` takes a lock in set(), and the main thread holds that same lock for a
few bytecodes of every wait() and clear(): a signal landing there runs a set() that waits
for a lock its own thread holds, for good (CPython issue 126434 is the multiprocessing
twin). `smoltorrent up` stayed up after a Ctrl-C that way, once in CI.

So set() here takes no lock: it sets a flag and writes a byte to a pipe the waiter
selects on (the self-pipe trick). A set() before the select leaves its byte in the pipe,
so no wake-up is lost.
"""

from __future__ import annotations

import contextlib
import os
import select


class SignalEvent:
    """threading.Event's is_set/set/clear/wait, with a set() safe in a signal handler.
    One thread waits; any thread or signal handler may set it."""

    def __init__(self) -> None:
        self._flag = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is already waiting
            os.write(self._write, b"\0")

    def clear(self) -> None:
        self._flag = False
        self._drain()

    def wait(self, timeout: float | None = None) -> bool:
        """Until set or `timeout` seconds; whether it is set. A signal's handler runs
        inside the select (which Python then resumes), so its set() wakes this."""
        if not self._flag:
            select.select([self._read], [], [], timeout)
            self._drain()
        return self._flag

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass

    def __del__(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
