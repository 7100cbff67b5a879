"""The on-disk store, in process: atomic puts, stable ids, safe names, verification."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from smoltorrent.errors import (
    DigestMismatchError,
    NotFoundError,
    ProtocolError,
    SmoltorrentError,
)
from worker_server.blob_store import BlobStore


def store_blob(store: BlobStore, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    with store.begin_put(digest, len(data)) as incoming:
        incoming.write(memoryview(data))
        incoming.commit()
    return digest


@pytest.fixture
def store(tmp_path: Path):
    blob_store = BlobStore(tmp_path / "data")
    yield blob_store
    blob_store.close()


def test_put_publishes_a_content_addressed_file(store: BlobStore) -> None:
    digest = store_blob(store, b"tensor bytes")
    assert (store.root / "blobs" / digest[:2] / digest).read_bytes() == b"tensor bytes"
    assert store.inventory() == {digest: 12}
    assert store.present([digest, "0" * 64]) == [digest]
    assert list(store.tmp_dir.iterdir()) == []


def test_digest_mismatch_leaves_nothing_behind(store: BlobStore) -> None:
    digest = hashlib.sha256(b"promised").hexdigest()
    with (
        pytest.raises(DigestMismatchError, match="send it again"),
        store.begin_put(digest, 8) as incoming,
    ):
        incoming.write(memoryview(b"received"))
        incoming.commit()
    assert not store.has(digest)
    assert list(store.tmp_dir.iterdir()) == []


def test_a_short_body_is_a_mismatch(store: BlobStore) -> None:
    data = b"0123456789"
    digest = hashlib.sha256(data).hexdigest()
    with pytest.raises(DigestMismatchError), store.begin_put(digest, 11) as incoming:
        incoming.write(memoryview(data))
        incoming.commit()


def test_an_abandoned_put_removes_its_temp_file(store: BlobStore) -> None:
    with pytest.raises(RuntimeError), store.begin_put("a" * 64, 4) as incoming:
        incoming.write(memoryview(b"ab"))
        raise RuntimeError("connection dropped")
    assert list(store.tmp_dir.iterdir()) == []


def test_stale_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    BlobStore(tmp_path).close()
    (tmp_path / "tmp" / "abc.part").write_bytes(b"half a blob")
    BlobStore(tmp_path).close()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_node_id_is_generated_once_and_kept(tmp_path: Path) -> None:
    first = BlobStore(tmp_path)
    first.close()
    second = BlobStore(tmp_path)
    second.close()
    assert first.node_id == second.node_id
    assert len(first.node_id) == 32


def test_a_corrupt_node_id_file_is_not_replaced(tmp_path: Path) -> None:
    BlobStore(tmp_path).close()
    (tmp_path / "node_id").write_text("not an id\n")
    with pytest.raises(SmoltorrentError, match="node id"):
        BlobStore(tmp_path)


def test_two_stores_cannot_share_a_directory(store: BlobStore) -> None:
    with pytest.raises(SmoltorrentError, match="already serving"):
        BlobStore(store.root)


def test_verify_reports_flipped_bits_and_missing_blobs(store: BlobStore) -> None:
    good = store_blob(store, b"good blob")
    bad = store_blob(store, b"blob to corrupt")
    path = store.blob_path(bad)
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(data)
    assert store.verify() == [bad]
    assert store.verify([good, "f" * 64]) == ["f" * 64]


def test_delete(store: BlobStore) -> None:
    digest = store_blob(store, b"x")
    assert store.delete(digest) is True
    assert store.delete(digest) is False
    with pytest.raises(NotFoundError):
        store.open_blob(digest)


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "../" + "a" * 61, ""])
def test_no_unchecked_name_becomes_a_path(store: BlobStore, name: str) -> None:
    with pytest.raises(ProtocolError):
        store.blob_path(name)
    with pytest.raises(ProtocolError):
        store.put_manifest(name, b"{}")


def test_manifests_are_written_whole_and_listed(store: BlobStore) -> None:
    store.put_manifest("run1.step_100", b'{"v": 1}')
    store.put_manifest("run1.step_100", b'{"v": 2}')
    store.put_manifest("run1.step_200", b"{}")
    assert store.list_manifests() == ["run1.step_100", "run1.step_200"]
    assert store.get_manifest("run1.step_100") == b'{"v": 2}'
    assert list(store.tmp_dir.iterdir()) == []
    with pytest.raises(NotFoundError):
        store.get_manifest("missing")


def test_stat_counts_blobs_and_space(store: BlobStore) -> None:
    store_blob(store, b"12345")
    stat = store.stat()
    assert stat["blob_count"] == 1 and stat["used_bytes"] == 5
    assert 0 < stat["free_bytes"] <= stat["total_bytes"]
    assert stat["node_id"] == store.node_id
    assert os.path.samefile(store.root, store.blobs_dir.parent)


def test_a_new_store_has_every_fan_out_bucket_so_a_put_makes_no_directory(
    store: BlobStore,
) -> None:
    # A put into a bucket not made yet pays a mkdir and an fsync of blobs/; on a fresh
    # node nearly every blob of a first store would land in a new bucket.
    buckets = sorted(p.name for p in store.blobs_dir.iterdir())
    assert buckets == [f"{i:02x}" for i in range(256)]
    assert all((store.blobs_dir / name).is_dir() for name in buckets)
    assert store.inventory() == {}
    assert store.inventory_page(None, 10) == ({}, False)


def test_reopening_a_store_keeps_its_blobs_and_buckets(tmp_path: Path) -> None:
    first = BlobStore(tmp_path / "data")
    digest = store_blob(first, b"kept")
    first.close()
    again = BlobStore(tmp_path / "data")
    try:
        assert again.inventory() == {digest: 4}
        assert len(list(again.blobs_dir.iterdir())) == 256
    finally:
        again.close()


def test_a_put_into_a_bucket_removed_by_hand_makes_it_again(store: BlobStore) -> None:
    data = b"after an operator's rm -r"
    bucket = store.blobs_dir / hashlib.sha256(data).hexdigest()[:2]
    bucket.rmdir()
    digest = store_blob(store, data)
    assert (bucket / digest).read_bytes() == data
    assert store.inventory() == {digest: len(data)}
