"""A token bucket: at most so many bytes a second, however many threads or processes send.

A store's or gather's `--bwlimit` (coordinator/dataplane/bandwidth.py) pays every slice it
moves to one; a node pays every slice of its repair pushes to its own (worker_server/
session.py, replicate), so the copies that heal a lost node leave its port room for
gathers. Standard library only: the node runs it.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from pathlib import Path

from smoltorrent import defaults

_STATE = struct.Struct("<d")  # the bucket's theoretical arrival time (time.monotonic)


class TokenBucket:
    """At most `rate` bytes/s on average, with bursts of BWLIMIT_BURST_S of it after an idle
    spell (a generic cell rate algorithm: the state is the time by which every byte paid
    for so far may have gone). take(n) waits until n more bytes may go."""

    def __init__(self, rate: int, path: str | os.PathLike | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"a bandwidth limit must be above 0 bytes/s, not {rate}")
        self.rate = rate
        self.burst_s = defaults.BWLIMIT_BURST_S
        self.path = None if path is None else os.fspath(path)
        self._lock = threading.Lock()
        self._due = 0.0  # in-process state, when there is no file

    @classmethod
    def shared(cls, rate: int, directory: str | os.PathLike, key: str) -> TokenBucket:
        """The bucket every process on this host that names `key` shares (the Celery
        children sending one store's shards). Monotonic time is one clock per host."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / key
        if not path.exists():
            _prune(directory)
        return cls(rate, path)

    def set_rate(self, rate: int) -> None:
        """Keep to `rate` from now on; what was paid for stays paid (a node's repair bucket
        takes the rate each replicate request names: the coordinator's setting)."""
        if rate <= 0:
            raise ValueError(f"a bandwidth limit must be above 0 bytes/s, not {rate}")
        with self._lock:
            self.rate = rate

    def take(self, n: int) -> None:
        """Pay for n bytes: return once they may go (at once within the burst)."""
        with self._lock:
            if self.path is None:
                wait, self._due = self._charge(self._due, n)
            else:
                wait = self._charge_file(n)
        if wait > 0:
            time.sleep(wait)

    def _charge(self, due: float, n: int) -> tuple[float, float]:
        now = time.monotonic()
        due = max(due, now)
        return due - self.burst_s - now, due + n / self.rate

    def _charge_file(self, n: int) -> float:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the close
            data = os.pread(fd, _STATE.size, 0)
            due = _STATE.unpack(data)[0] if len(data) == _STATE.size else 0.0
            wait, due = self._charge(due, n)
            os.pwrite(fd, _STATE.pack(due), 0)
        finally:
            os.close(fd)
        return wait


def _prune(directory: Path) -> None:
    """Remove bucket files of transfers long over (best effort: another process may too)."""
    cutoff = time.time() - defaults.BWLIMIT_STATE_MAX_AGE_S
    for entry in directory.iterdir():
        try:
            if entry.stat().st_mtime < cutoff:
                entry.unlink()
        except OSError:
            continue
