"""A node on a 4 MiB file system: puts that cannot fit fail as disk_full and leave no trace."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from smoltorrent.errors import DiskFullError, NodeError
from tests.conftest import SMALL_FS_BYTES
from tests.nodeproc import NodeProcess, start_node
from tests.worker_server.conftest import CLUSTER_KEY, SourceBlob
from worker_server import wire
from worker_server.blob_store import BlobStore

READ_TIMEOUT_S = 5.0  # seconds; generous for loopback


@pytest.fixture
def small_node(small_fs: Path) -> Iterator[NodeProcess]:
    node = start_node(small_fs, CLUSTER_KEY)  # its log lands beside the mount, not on it
    yield node
    node.kill()


def tmp_files(node: NodeProcess) -> list[Path]:
    return list((node.data_dir / "tmp").iterdir())


def fill_up(path: Path) -> None:
    """Write zeros to path until its file system has no space left."""
    with open(path, "wb", buffering=0) as fill, pytest.raises(OSError):
        while True:
            fill.write(b"\0" * 65536)


def test_blob_larger_than_free_space_is_refused(small_node: NodeProcess, make_blob) -> None:
    client = small_node.client()
    blob: SourceBlob = make_blob(SMALL_FS_BYTES + 1024 * 1024)
    with pytest.raises(NodeError) as full:
        blob.put(client)
    assert full.value.code == "disk_full"
    assert "free" in str(full.value)
    assert tmp_files(small_node) == []
    assert client.has([blob.digest]) == set()
    fits: SourceBlob = make_blob(1024 * 1024)
    assert fits.put(client) is True


def test_disk_filling_up_mid_transfer(small_node: NodeProcess, make_blob) -> None:
    """The space goes while the body streams in: disk_full after it, temp file gone."""
    blob: SourceBlob = make_blob(3 * 1024 * 1024)
    size = len(blob.content)
    assert small_node.address is not None
    with wire.connect(small_node.address.host, small_node.address.port, READ_TIMEOUT_S) as sock:
        wire.client_handshake(sock, CLUSTER_KEY, str(small_node.address))
        request = {"op": "put", "digest": blob.digest, "size": size}
        wire.send_frame_header(sock, request, size)
        assert wire.recv_frame_header(sock)[0]["status"] == "continue"
        filler = small_node.data_dir / "filler"
        fill_up(filler)  # someone else takes the space meanwhile
        sock.sendall(blob.content)
        error, _ = wire.recv_frame_header(sock)
        assert error["error"] == "disk_full", error
        # The stream stayed in step, so the connection can carry another request.
        wire.send_frame(sock, {"op": "ping"})
        assert wire.recv_frame_header(sock)[0]["ok"] is True
    assert tmp_files(small_node) == []
    filler.unlink()
    assert small_node.client().has([blob.digest]) == set()
    assert blob.put(small_node.client()) is True


def test_manifest_on_a_full_disk(small_fs: Path) -> None:
    store = BlobStore(small_fs / "data")
    try:
        with pytest.raises(DiskFullError, match="free some disk space"):
            store.put_manifest("big", b"x" * (SMALL_FS_BYTES + 1))
        assert list(store.tmp_dir.iterdir()) == []
    finally:
        store.close()
    assert os.listdir(small_fs / "data" / "manifests") == []
