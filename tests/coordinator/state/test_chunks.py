"""The chunks room (coordinator/state/chunks.py): which blob holds each raw chunk."""

from __future__ import annotations

import hashlib

from coordinator.dataplane import codec
from coordinator.plan.manifest_entries import ChunkEntry
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
    encodings = [f"made{i % 2}" for i in range(10)]
    md.chunks.record(iter(chunks), encodings)  # any iterable: the tuple, or a generator
    assert md.r.info("commandstats")["cmdstat_hset"]["calls"] == 3
    assert md.r.hgetall(K.CHUNKS) == {
        c.raw_sha256: f"{c.blob_sha256} {c.blob_size} made{c.index % 2}" for c in chunks
    }
    md.chunks.record([])
    assert md.r.hlen(K.CHUNKS) == 10


def used(md, chunk: ChunkEntry, node: str = "n1") -> None:
    """The chunk's blob in use by a version and on a node: stored, as far as Redis says."""
    md.r.sadd(K.BLOB_REFS.format(digest=chunk.blob_sha256), "v1")
    md.r.sadd(K.PLACEMENT.format(digest=chunk.blob_sha256), node)


def test_a_stored_chunk_counts_only_for_a_store_that_would_encode_it_as_that_blob(md):
    """The same raw bytes in another dtype are another blob (zeros in bf16 and in fp32): a
    lookup with another encoding misses, one with the blob's own finds it, and a RAW
    blob (the raw bytes themselves) is found whatever the encoding asked. An entry that
    names no encoding (recorded by a rebuild) counts for none."""
    encoded, raw, unnamed = entry(0), entry(1), entry(2)
    raw = ChunkEntry(1, 10, 20, raw.raw_sha256, 10, raw.raw_sha256)  # blob size = raw size
    for chunk in (encoded, raw, unnamed):
        used(md, chunk)
    md.chunks.record([encoded, raw], ["w2", codec.RAW_ENCODING])
    md.chunks.record([unnamed])
    asked = [(c.raw_sha256, e) for c in (encoded, raw, unnamed) for e in ("w2", "w4")]
    assert md.chunks.stored(asked) == {
        (encoded.raw_sha256, "w2"): (encoded.blob_sha256, encoded.blob_size),
        (raw.raw_sha256, "w2"): (raw.blob_sha256, raw.blob_size),
        (raw.raw_sha256, "w4"): (raw.blob_sha256, raw.blob_size),
    }
    md.r.set(K.BLOB_DELETING.format(digest=encoded.blob_sha256), "v0")  # a remove deletes it
    assert (encoded.raw_sha256, "w2") not in md.chunks.stored(asked)
