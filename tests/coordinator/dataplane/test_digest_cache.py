"""Plan-time digests cached by the source file's identity: an unchanged file is not
hashed again, and any rewrite (even one that restores size and mtime) is."""

from __future__ import annotations

import os

from coordinator.dataplane.chunk_engine import prepare_chunked_store
from coordinator.dataplane.digest_cache import DigestCache
from coordinator.dataplane.store_engine import prepare_store
from coordinator.local.synthetic import write_checkpoint
from tests.coordinator.dataplane.test_chunk_engine import ChunksRoom

FREE = {"a": 1 << 40, "b": 1 << 40}


def prepare(path, cache):
    return prepare_store(path, path.name, FREE, replicas=2, shards=3, digest_cache=cache)


def test_an_unchanged_file_is_not_hashed_again(tmp_path):
    src = tmp_path / "c.safetensors"
    write_checkpoint(src, 3 << 20, hidden=256)
    cache = DigestCache(tmp_path / "cache")
    first = prepare(src, cache)
    again = prepare(src, cache)
    assert first.hashed_bytes > 0 and again.hashed_bytes == 0
    assert again.manifest.shards == first.manifest.shards
    assert again.manifest.version_id == first.manifest.version_id
    # Another shard count is another plan: hashed afresh, not served the wrong digests.
    other = prepare_store(src, src.name, FREE, shards=2, digest_cache=cache)
    assert other.hashed_bytes > 0


def test_a_rewrite_that_restores_size_and_mtime_is_hashed_again(tmp_path):
    src = tmp_path / "c.safetensors"
    write_checkpoint(src, 3 << 20, hidden=256)
    cache = DigestCache(tmp_path / "cache")
    first = prepare(src, cache)
    st = os.stat(src)
    data = bytearray(src.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor, in place: same inode and size
    with open(src, "r+b") as f:
        f.write(data)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime, as rsync -t would
    again = prepare(src, cache)
    assert again.hashed_bytes > 0
    assert again.manifest.shards[-1].blob_sha256 != first.manifest.shards[-1].blob_sha256


def test_a_damaged_entry_is_a_miss_and_entries_are_bounded(tmp_path):
    src = tmp_path / "c.safetensors"
    write_checkpoint(src, 1 << 20, hidden=128)
    cache = DigestCache(tmp_path / "cache", max_entries=2)
    prepare(src, cache)
    (entry,) = (tmp_path / "cache").glob("*.json")
    entry.write_text("{not json")
    assert prepare(src, cache).hashed_bytes > 0
    for shards in (1, 2, 4):
        prepare_store(src, src.name, FREE, shards=shards, digest_cache=cache)
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2


def test_a_chunked_store_of_an_unchanged_file_reads_none_of_its_stored_chunks(tmp_path):
    """A chunked store asks which chunks are stored by their raw digests: cached, an
    unchanged file whose chunks are all stored is not read at all; a rewrite is read."""
    src = tmp_path / "c.safetensors"
    write_checkpoint(src, 3 << 20, hidden=256)
    cache = DigestCache(tmp_path / "cache")
    room = ChunksRoom()

    def prepare_chunks(encode: bool):
        p = prepare_chunked_store(
            src,
            src.name,
            FREE,
            tmp_path / "spool",
            lookup=room,
            encode=encode,
            digest_cache=cache,
        )
        room.record(p)
        return p

    first = prepare_chunks(encode=True)
    assert first.hashed_bytes > 0
    for encode in (True, False):
        again = prepare_chunks(encode)
        assert again.hashed_bytes == 0 and again.known == frozenset(range(len(first.spans)))
        assert again.manifest.chunks == first.manifest.chunks
    st = os.stat(src)
    data = bytearray(src.read_bytes())
    data[-1] ^= 0xFF  # in place, the old mtime restored: only ctime tells
    with open(src, "r+b") as f:
        f.write(data)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = prepare_chunks(encode=True)
    assert changed.hashed_bytes > 0
    assert changed.manifest.chunks[-1].raw_sha256 != first.manifest.chunks[-1].raw_sha256
