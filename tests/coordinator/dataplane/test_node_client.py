"""NodeClient: address parsing, failure mapping, and what it refuses from a node."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator.dataplane import node_client
from coordinator.dataplane.node_client import KeptConnections, NodeAddress, NodeClient
from smoltorrent import defaults
from smoltorrent.errors import (
    AuthenticationError,
    NodeError,
    NodeUnavailableError,
    ProtocolError,
    SmoltorrentError,
)
from tests.nodeproc import NodeProcess, node_metric, start_node
from worker_server import protocol, wire

KEY = b"client-test-key"
FAKE_NODE_ID = "f" * 32
SHORT_TIMEOUT_S = 0.5  # seconds; the client's patience in tests where the node stalls


@pytest.fixture(autouse=True)
def _no_cluster_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SMOLTORRENT_CLUSTER_KEY", raising=False)


@pytest.fixture(scope="module")
def keyed_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    node = start_node(tmp_path_factory.mktemp("client") / "data", KEY)
    yield node
    node.stop()


@pytest.fixture
def fake_node() -> Iterator[Callable[[Callable[[socket.socket], None]], NodeAddress]]:
    """fake_node(script) -> the address of a one-connection server that runs script(conn)."""
    listeners: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def start(script: Callable[[socket.socket], None]) -> NodeAddress:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                script(conn)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        threads.append(thread)
        return NodeAddress("127.0.0.1", listener.getsockname()[1])

    yield start
    for listener in listeners:
        listener.close()
    for thread in threads:
        thread.join(5)


def send_hello(conn: socket.socket, auth: str = "none") -> bytes:
    nonce = os.urandom(defaults.NONCE_BYTES)
    hello = {"op": "hello", "protocol": defaults.PROTOCOL_VERSION, "node_id": FAKE_NODE_ID}
    wire.send_frame(conn, {**hello, "auth": auth, "nonce": nonce.hex()})
    return nonce


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("pi4.local:7411", NodeAddress("pi4.local", 7411)),
        ("10.0.0.7:1", NodeAddress("10.0.0.7", 1)),
        ("[fe80::1]:7411", NodeAddress("fe80::1", 7411)),
        (" pi4:65535 ", NodeAddress("pi4", 65535)),
    ],
)
def test_address_parse(text: str, address: NodeAddress) -> None:
    assert NodeAddress.parse(text) == address
    assert NodeAddress.parse(str(address)) == address


@pytest.mark.parametrize("text", ["pi4", "pi4:", ":7411", "pi4:0", "pi4:70000", "fe80::1:7411"])
def test_address_parse_rejects(text: str) -> None:
    with pytest.raises(SmoltorrentError, match="host:port"):
        NodeAddress.parse(text)


def test_unreachable_node_names_the_address() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nobody listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(NodeUnavailableError, match=f"127.0.0.1:{port}.*running"):
        NodeClient(NodeAddress("127.0.0.1", port)).ping()


def test_key_comes_from_the_environment(
    keyed_node: NodeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert keyed_node.address is not None
    monkeypatch.setenv("SMOLTORRENT_CLUSTER_KEY", KEY.decode())
    assert NodeClient(keyed_node.address).ping() == keyed_node.client().ping()


def test_keyed_client_refuses_a_keyless_node(fake_node) -> None:
    address = fake_node(send_hello)
    with pytest.raises(AuthenticationError, match="has no cluster key; start it with --key-file"):
        NodeClient(address, cluster_key=KEY).ping()


def test_node_that_cannot_prove_the_key_is_refused(fake_node) -> None:
    def impostor(conn: socket.socket) -> None:
        send_hello(conn, auth="hmac-sha256")
        wire.recv_frame_header(conn)
        nonce = b"x" * defaults.NONCE_BYTES
        proof = protocol.client_proof(b"guess", nonce, nonce, FAKE_NODE_ID)
        wire.send_frame(conn, {"ok": True, "mac": proof})

    with pytest.raises(AuthenticationError, match="could not prove"):
        NodeClient(fake_node(impostor), cluster_key=KEY).ping()


def test_busy_node(fake_node) -> None:
    def busy(conn: socket.socket) -> None:
        wire.send_frame(conn, protocol.error_header("busy", "retry shortly."))

    with pytest.raises(NodeError) as refused:
        NodeClient(fake_node(busy)).ping()
    assert refused.value.code == "busy"


def test_stalled_node_times_out(fake_node) -> None:
    stop = threading.Event()

    def stall(conn: socket.socket) -> None:
        send_hello(conn)
        stop.wait(5)

    address = fake_node(stall)
    try:
        with pytest.raises(NodeUnavailableError, match="stopped answering"):
            NodeClient(address, timeout=SHORT_TIMEOUT_S).ping()
    finally:
        stop.set()


def test_connection_ending_mid_blob(fake_node, tmp_path: Path) -> None:
    def short_blob(conn: socket.socket) -> None:
        send_hello(conn)
        wire.recv_frame_header(conn)
        conn.sendall(protocol.encode_frame({"ok": True, "length": 1000}, 1000) + b"x" * 10)

    with open(tmp_path / "out", "wb") as out, pytest.raises(NodeUnavailableError, match="10 of"):
        NodeClient(fake_node(short_blob)).get_blob_to_file("a" * 64, out.fileno(), 0)


def test_oversized_answer_is_not_read(fake_node) -> None:
    def oversized(conn: socket.socket) -> None:
        send_hello(conn)
        wire.recv_frame_header(conn)
        conn.sendall(protocol.encode_frame({"ok": True}, defaults.MAX_JSON_BODY_BYTES + 1))

    with pytest.raises(SmoltorrentError, match="limit"):
        NodeClient(fake_node(oversized)).list_blobs()


@pytest.mark.parametrize("declared", ["huge", "growing"])
def test_a_manifest_a_node_declares_without_end_is_not_accumulated(
    fake_node, declared, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that answers every manifest_get with a full part and a size of 1 PiB (or a
    size that grows with each part) is refused once it declares more than any manifest
    can be, not read part after part into memory."""
    monkeypatch.setattr(defaults, "MAX_MANIFEST_BYTES", 8 * 1024 * 1024)  # 1 GiB, scaled
    parts = 0
    part = b"x" * (1024 * 1024)

    def endless(conn: socket.socket) -> None:
        nonlocal parts
        send_hello(conn)
        with contextlib.suppress(OSError):
            # Stops a while past the limit, so a client without one fails here, not by
            # taking all the test machine's memory.
            while parts < 16 and wire.recv_frame_header(conn) is not None:
                parts += 1
                size = 2**50 if declared == "huge" else parts * len(part) + 1
                wire.send_frame(conn, {"ok": True, "size": size}, part)

    with pytest.raises(ProtocolError, match="manifest"):
        NodeClient(fake_node(endless)).get_manifest("k")
    assert parts * len(part) <= defaults.MAX_MANIFEST_BYTES + len(part)


def test_put_and_get_through_the_client(keyed_node: NodeProcess, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.write_bytes(b"....tensor data....")
    content = b"HDR" + b"tensor data"
    digest = hashlib.sha256(content).hexdigest()
    client = keyed_node.client()
    with open(source, "rb") as src:
        assert client.put_blob(digest, b"HDR", src.fileno(), 4, 11) is True
    with open(tmp_path / "out", "w+b") as out:
        assert client.get_blob_to_file(digest, out.fileno(), 0) == digest
        assert os.pread(out.fileno(), 100, 0) == content


@pytest.mark.parametrize("looked", [True, False])
def test_kept_connections_are_reused_and_replaced_once_the_node_closed_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, looked: bool
) -> None:
    """Reads sharing KeptConnections go over one connection; one the node closed while it
    sat idle (its socket timeout, a restart) is not an error: the read opens another.
    Whether the close shows when the connection is taken or only once the request is
    sent (`looked` False: the node closed it just after the look)."""
    if not looked:
        monkeypatch.setattr(node_client.wire, "quiet", lambda sock: True)
    env = dict(os.environ, SMOLTORRENT_METRICS_PORT="0")
    node = NodeProcess(tmp_path / "data", KEY, socket_timeout=SHORT_TIMEOUT_S, env=env).start()
    try:
        content = os.urandom(3 * defaults.IO_CHUNK_BYTES)
        digest = hashlib.sha256(content).hexdigest()
        (tmp_path / "source").write_bytes(content)
        with open(tmp_path / "source", "rb") as src:
            node.client().put_blob(digest, b"", src.fileno(), 0, len(content))

        def accepted() -> float:
            return node_metric(node, "smoltorrent_node_connections_accepted_total")

        with KeptConnections() as kept, open(tmp_path / "out", "w+b") as out:
            client = node.client().keeping(kept)

            def read_twice() -> None:
                before = accepted()
                for _ in range(2):
                    assert client.get_blob_to_file(digest, out.fileno(), 0) == digest
                    pieces: list[bytes] = []
                    client.read_blob(digest, lambda piece, into=pieces: into.append(bytes(piece)))
                    assert b"".join(pieces) == content
                assert accepted() - before == 1  # four reads, one connection

            read_twice()
            time.sleep(SHORT_TIMEOUT_S * 3)  # the node drops the idle connection
            read_twice()
            node.restart()  # same port: the kept connection's far end is gone
            read_twice()
            assert os.pread(out.fileno(), len(content) + 1, 0) == content
    finally:
        node.kill()
