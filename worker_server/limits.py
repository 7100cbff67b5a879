"""What one node lets its peers hold at once: connections per address, JSON body bytes.

Each limit answers at once instead of blocking, so the caller can refuse the
request with a `busy` frame and a log line while everyone else is served.
"""

from __future__ import annotations

import threading
from collections import Counter


class AddressSlots:
    """At most `per_address` open connections from one remote address."""

    def __init__(self, per_address: int) -> None:
        self.per_address = per_address
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()

    def acquire(self, address: str) -> bool:
        with self._lock:
            if self._open[address] >= self.per_address:
                return False
            self._open[address] += 1
            return True

    def release(self, address: str) -> None:
        with self._lock:
            self._open[address] -= 1
            if self._open[address] <= 0:
                del self._open[address]


class MemoryBudget:
    """Bytes that requests may hold in memory together (their declared JSON bodies)."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self._reserved = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._reserved + nbytes > self.total_bytes:
                return False
            self._reserved += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes
