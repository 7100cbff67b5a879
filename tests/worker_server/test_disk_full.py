"""A node on a 4 MiB file system: puts that cannot fit fail as disk_full and leave no trace."""

from __future__ import annotations

import os
import time
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


def _begin_put(node: NodeProcess, blob: SourceBlob):
    """A put announced on its own connection, no byte of its body sent yet: (socket, the
    node's answer)."""
    assert node.address is not None
    sock = wire.connect(node.address.host, node.address.port, READ_TIMEOUT_S)
    wire.client_handshake(sock, CLUSTER_KEY, str(node.address))
    wire.send_frame_header(
        sock, {"op": "put", "digest": blob.digest, "size": len(blob.content)}, len(blob.content)
    )
    return sock, wire.recv_frame_header(sock)[0]


def test_concurrent_puts_never_overcommit_the_disk(small_node: NodeProcess, make_blob) -> None:
    """Two puts of 2.5 MiB on a 4 MiB disk at once: the first reserves its size when it
    begins, so the second is refused before a byte is sent, not half-way through (both
    were accepted: begin_put checked free space and reserved none). The reservation goes
    when a put is published or its connection dies."""
    first, second, third = (make_blob(5 * 512 * 1024) for _ in range(3))
    sock, answer = _begin_put(small_node, first)
    with sock:
        assert answer["status"] == "continue"
        refused, refused_answer = _begin_put(small_node, second)
        refused.close()
        assert refused_answer.get("error") == "disk_full", refused_answer
        assert "in flight" in refused_answer["message"]
        sock.sendall(first.content)
        assert wire.recv_frame_header(sock)[0]["status"] == "stored"
    assert small_node.client().has([first.digest]) == {first.digest}
    assert small_node.client().delete(first.digest)
    # A put whose sender vanished mid-body releases what it reserved.
    sock, answer = _begin_put(small_node, second)
    assert answer["status"] == "continue"
    sock.sendall(second.content[:1024])
    sock.close()
    deadline = time.monotonic() + READ_TIMEOUT_S
    while small_node.client().stat().free_bytes < len(third.content):
        assert time.monotonic() < deadline, "the vanished put kept its reservation"
        time.sleep(0.02)
    assert third.put(small_node.client()) is True
