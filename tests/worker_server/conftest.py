"""Shard servers as separate processes on loopback, and blobs to send them."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.dataplane.node_client import NodeClient
from tests.nodeproc import NodeProcess, start_node

CLUSTER_KEY = b"test-cluster-key"
STALL_TIMEOUT_S = 1.0  # seconds; the server's socket timeout in tests that stall on purpose


@pytest.fixture(autouse=True)
def _no_cluster_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # A key exported in the developer's shell would silently change what these tests mean.
    monkeypatch.delenv("SMOLTORRENT_CLUSTER_KEY", raising=False)


@pytest.fixture(scope="session")
def keyed_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node with a cluster key and a short socket timeout, shared by the session."""
    node = start_node(
        tmp_path_factory.mktemp("keyed") / "data", CLUSTER_KEY, socket_timeout=STALL_TIMEOUT_S
    )
    yield node
    node.stop()


@pytest.fixture(scope="session")
def keyless_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    node = start_node(tmp_path_factory.mktemp("keyless") / "data")
    yield node
    node.stop()


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """Start nodes private to one test; all are stopped (or killed) afterwards."""
    started: list[NodeProcess] = []

    def factory(name: str = "node", cluster_key: bytes | None = CLUSTER_KEY) -> NodeProcess:
        node = start_node(tmp_path / name, cluster_key, socket_timeout=STALL_TIMEOUT_S)
        started.append(node)
        return node

    yield factory
    for node in started:
        node.kill()


@dataclass
class SourceBlob:
    """A blob as the coordinator sends it: a header prefix, then a byte range of a file."""

    digest: str
    prefix: bytes
    fd: int
    offset: int
    length: int
    content: bytes  # prefix + range, to compare against what comes back

    def put(self, client: NodeClient) -> bool:
        return client.put_blob(self.digest, self.prefix, self.fd, self.offset, self.length)


@pytest.fixture
def make_blob(tmp_path: Path) -> Iterator[Callable[[int], SourceBlob]]:
    """make_blob(size) -> a SourceBlob of random bytes, backed by a real file."""
    fds: list[int] = []

    def factory(size: int, prefix: bytes = b"HEADER") -> SourceBlob:
        padding = os.urandom(7)  # the range starts mid-file, as a shard does
        data = os.urandom(size)
        path = tmp_path / f"source-{len(fds)}"
        path.write_bytes(padding + data + padding)
        fd = os.open(path, os.O_RDONLY)
        fds.append(fd)
        content = prefix + data
        digest = hashlib.sha256(content).hexdigest()
        return SourceBlob(digest, prefix, fd, len(padding), size, content)

    yield factory
    for fd in fds:
        os.close(fd)
