"""What a transfer puts on the wire: one token bucket for its bandwidth limit, and the one
place its raw and wire bytes are counted.

A transfer (a store, a gather) makes one `WireMeter`; every node client it uses is
`paced` by it, and the socket layer (worker_server/wire.py) calls `meter.wire(n)` for
each slice of at most BWLIMIT_SLICE_BYTES that leaves or arrives, sendfile included. So
however many sends run at once, threads of one process or Celery children sending the
shards of one store (`TokenBucket.shared`: its state in a file on this host), the bytes
they move together keep to one rate.

Wire bytes are counted at the socket; raw bytes (what those bytes are in the checkpoint,
decoded) by the engine or task that knows what a blob holds, with `meter.raw(n)`. Stored
whole, a shard's blob is its raw bytes (ratio 1.0); an encoded chunk is fewer bytes on
the wire than the raw ones it carries.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from coordinator.plan.manifest import BlobSpan
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


@dataclass(frozen=True)
class WireBytes:
    """A transfer's figures: raw bytes (as they are in the checkpoint) and wire bytes (what
    the link carried for them); ratio = raw / wire, above 1 when encoding saved bytes."""

    raw_bytes: int = 0
    wire_bytes: int = 0

    @property
    def ratio(self) -> float:
        return round(self.raw_bytes / self.wire_bytes, 3) if self.wire_bytes else 1.0

    def to_dict(self) -> dict[str, float]:
        return {"raw_bytes": self.raw_bytes, "wire_bytes": self.wire_bytes, "ratio": self.ratio}


class WireMeter:
    """One transfer's counter of raw and wire bytes, and its bucket when it is limited.
    Thread-safe; give it to the clients (NodeClient.paced)."""

    def __init__(self, bucket: TokenBucket | None = None) -> None:
        self.bucket = bucket
        self._lock = threading.Lock()
        self._raw = 0
        self._wire = 0

    @classmethod
    def limited(
        cls, rate: int | None, directory: str | os.PathLike | None = None, key: str = ""
    ) -> WireMeter:
        """A meter whose sends keep to `rate` bytes/s (None or 0: no limit), in this process
        alone, or, with `directory` and `key`, with every process sharing that key."""
        if not rate:
            return cls()
        if directory is None:
            return cls(TokenBucket(rate))
        return cls(TokenBucket.shared(rate, directory, key))

    @property
    def slice_bytes(self) -> int | None:
        """The most bytes one recv or sendfile of a metered client moves before wire() is
        told (NodeClient.paced): a limited meter's BWLIMIT_SLICE_BYTES, so its bucket keeps
        the link's bursts short; None without a limit, each step as large as an unmetered
        one (a 1 GB gather otherwise made 4 times the recv, hash and pwrite calls)."""
        return None if self.bucket is None else defaults.BWLIMIT_SLICE_BYTES

    def wire(self, n: int) -> None:
        """n bytes went on (or came off) the wire; waits while they are over the limit."""
        with self._lock:
            self._wire += n
        if self.bucket is not None:
            self.bucket.take(n)

    def raw(self, n: int) -> None:
        """n bytes of the checkpoint, as they are in it, were delivered (or written)."""
        with self._lock:
            self._raw += n

    @property
    def totals(self) -> WireBytes:
        with self._lock:
            return WireBytes(self._raw, self._wire)


def raw_size(span: BlobSpan) -> int:
    """The raw bytes a blob carries: its source range and its own header. A shard's blob is
    exactly that; an encoded chunk's blob is fewer bytes (span.size) for the same range."""
    return len(span.prefix) + span.length
