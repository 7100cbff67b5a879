"""The chunks room (coordinator/state/chunks.py): which blob holds each raw chunk."""

from __future__ import annotations

import hashlib

from coordinator.plan.manifest import ChunkEntry
from coordinator.state import redis_keys as K
from smoltorrent import defaults


def entry(i: int) -> ChunkEntry:
    raw, blob = (hashlib.sha256(f"{side}{i}".encode()).hexdigest() for side in "rb")
    return ChunkEntry(i, 10 * i, 10 * i + 10, raw, 100 + i, blob)


def test_record_writes_every_chunk_a_batch_at_a_time(md, monkeypatch):
    """A store of thousands of chunks records them in batches (its arguments never all at
    once in the worker): every chunk is recorded, the last batch shorter, none twice."""
    monkeypatch.setattr(defaults, "CHUNK_RECORD_BATCH", 4)
    chunks = [entry(i) for i in range(10)]
    md.r.config_resetstat()
    md.chunks.record(iter(chunks))  # any iterable: the manifest's tuple, or a generator
    assert md.r.info("commandstats")["cmdstat_hset"]["calls"] == 3
    assert md.r.hgetall(K.CHUNKS) == {
        c.raw_sha256: f"{c.blob_sha256} {c.blob_size}" for c in chunks
    }
    md.chunks.record([])
    assert md.r.hlen(K.CHUNKS) == 10
