"""What a transfer puts on the wire: one token bucket for its bandwidth limit, and the one
place its raw and wire bytes are counted.

A transfer (a store, a gather) makes one `WireMeter`; every node client it uses is
`paced` by it, and the socket layer (worker_server/wire.py) calls `meter.wire(n)` for
each slice of at most BWLIMIT_SLICE_BYTES that leaves or arrives, sendfile included. So
however many sends run at once, threads of one process or Celery children sending the
shards of one store (`TokenBucket.shared`: its state in a file on this host), the bytes
they move together keep to one rate. The bucket itself is worker_server/token_bucket.py:
a node paces its repair pushes with it too.

Wire bytes are counted at the socket; raw bytes (what those bytes are in the checkpoint,
decoded) by the engine or task that knows what a blob holds, with `meter.raw(n)`. Stored
whole, a shard's blob is its raw bytes (ratio 1.0); an encoded chunk is fewer bytes on
the wire than the raw ones it carries.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from coordinator.plan.blob_spans import BlobSpan
from smoltorrent import defaults
from worker_server.token_bucket import TokenBucket


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
