"""Raw-socket clients that break the protocol: each one is refused, and the node serves on."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator.dataplane.node_client import NodeClient
from smoltorrent import defaults
from smoltorrent.errors import AuthenticationError
from tests.nodeproc import NodeProcess
from tests.worker_server.conftest import CLUSTER_KEY, STALL_TIMEOUT_S
from worker_server import protocol, wire

READ_TIMEOUT_S = 5.0  # seconds; far above the node's 1 s stall timeout
DIGEST = "cd" * 32


@pytest.fixture
def node(keyed_node: NodeProcess) -> Iterator[NodeProcess]:
    """The shared keyed node, checked to still serve a normal client after each test."""
    yield keyed_node
    assert keyed_node.client().ping()
    assert keyed_node.is_running()


def greeted_connection(node: NodeProcess) -> tuple[socket.socket, dict[str, Any]]:
    """A connection that has read the node's hello; (socket, the hello)."""
    assert node.address is not None
    sock = wire.connect(node.address.host, node.address.port, READ_TIMEOUT_S)
    hello, _ = wire.recv_frame_header(sock)
    assert hello["op"] == "hello" and hello["auth"] == "hmac-sha256"
    return sock, hello


def raw_connection(node: NodeProcess) -> socket.socket:
    return greeted_connection(node)[0]


def authenticated_connection(node: NodeProcess) -> wire.SessionSocket:
    assert node.address is not None
    sock = wire.connect(node.address.host, node.address.port, READ_TIMEOUT_S)
    wire.client_handshake(sock, CLUSTER_KEY, str(node.address))
    return sock


def auth_frame(key: bytes, hello: dict[str, Any], client_nonce: bytes) -> dict[str, Any]:
    server_nonce = bytes.fromhex(hello["nonce"])
    mac = protocol.client_proof(key, server_nonce, client_nonce, hello["node_id"])
    return {"op": "auth", "mac": mac, "nonce": client_nonce.hex()}


def frame_bytes(
    header_bytes: bytes, body_len: int = 0, version: int = defaults.PROTOCOL_VERSION
) -> bytes:
    prefix = protocol.PREFIX.pack(b"SMTR", version, 0, 0, len(header_bytes), body_len)
    return prefix + header_bytes


def sealed(sock: wire.SessionSocket, frame_head: bytes) -> bytes:
    """A hand-made frame head with the tag this authenticated connection expects next,
    so the node judges what the frame says, not its tag."""
    assert sock.frame_auth is not None
    return frame_head + sock.frame_auth.seal(frame_head)


def expect_error(sock: socket.socket, code: str) -> dict[str, Any]:
    header, _ = wire.recv_frame_header(sock)
    assert header["ok"] is False and header["error"] == code, header
    assert header["message"]
    return header


def expect_closed(sock: socket.socket) -> None:
    with contextlib.suppress(ConnectionResetError):  # a reset is a close too
        assert sock.recv(1 << 20) == b""
    sock.close()


def test_random_garbage(node: NodeProcess) -> None:
    sock = raw_connection(node)
    sock.sendall(b"\x00garbage" + os.urandom(8192))
    expect_error(sock, "bad_request")
    expect_closed(sock)


def test_pickle_payload_before_and_after_auth(node: NodeProcess) -> None:
    payload = pickle.dumps(("os", "system", "touch /tmp/pwned"))
    sock = raw_connection(node)
    sock.sendall(payload)
    expect_error(sock, "bad_request")
    expect_closed(sock)
    sock = authenticated_connection(node)
    sock.sendall(sealed(sock, frame_bytes(payload)))  # a well-formed prefix, a pickled header
    expect_error(sock, "bad_request")
    expect_closed(sock)


@pytest.mark.parametrize("body_len", [2**63, 2**64 - 1])
def test_body_length_near_2_to_64(node: NodeProcess, body_len: int) -> None:
    sock = authenticated_connection(node)
    sock.sendall(sealed(sock, frame_bytes(b'{"op":"has"}', body_len)))
    expect_error(sock, "too_large")
    expect_closed(sock)


def test_largest_allowed_body_is_not_allocated(node: NodeProcess) -> None:
    sock = authenticated_connection(node)
    huge = defaults.MAX_BLOB_BYTES
    sock.sendall(sealed(sock, frame_bytes(b'{"op":"manifest_put","key":"k"}', huge)))
    expect_error(sock, "too_large")
    expect_closed(sock)
    sock = authenticated_connection(node)
    wire.send_frame_header(sock, {"op": "put", "digest": DIGEST, "size": huge}, huge)
    expect_error(sock, "disk_full")  # refused before a single body byte is asked for
    sock.close()


def test_wrong_protocol_version(node: NodeProcess) -> None:
    sock = authenticated_connection(node)
    sock.sendall(sealed(sock, frame_bytes(b'{"op":"ping"}', version=99)))
    expect_error(sock, "unsupported_version")
    expect_closed(sock)


@pytest.mark.parametrize(
    "header",
    [
        {"op": "get", "digest": "../../../../etc/passwd"},
        {"op": "get", "digest": "/etc/passwd"},
        {"op": "delete", "digest": "../" + DIGEST[3:]},
        {"op": "manifest_get", "key": "../node_id"},
        {"op": "manifest_get", "key": "/etc/passwd"},
        {"op": "manifest_get", "key": "..\\..\\x"},
        {"op": "replicate", "digest": DIGEST, "peer": "evil.example;rm -rf /:1"},
    ],
)
def test_traversal_and_absolute_names(node: NodeProcess, header: dict[str, Any]) -> None:
    sock = authenticated_connection(node)
    wire.send_frame(sock, header)
    expect_error(sock, "bad_request")
    # No body was pending, so the same connection keeps serving.
    wire.send_frame(sock, {"op": "ping"})
    assert wire.recv_frame_header(sock)[0]["ok"] is True
    sock.close()


def test_traversal_key_with_a_body_writes_nothing(node: NodeProcess) -> None:
    sock = authenticated_connection(node)
    body = b'{"owned": true}'
    wire.send_frame(sock, {"op": "manifest_put", "key": "../../evil"}, body)
    expect_error(sock, "bad_request")
    expect_closed(sock)
    assert not (node.data_dir.parent / "evil.json").exists()
    assert not list(node.data_dir.parent.parent.glob("evil*"))


def test_stall_mid_body_is_timed_out(node: NodeProcess) -> None:
    sock = authenticated_connection(node)
    size = 4 * 1024 * 1024
    wire.send_frame_header(sock, {"op": "put", "digest": DIGEST, "size": size}, size)
    assert wire.recv_frame_header(sock)[0]["status"] == "continue"
    sock.sendall(os.urandom(100_000))
    assert list((node.data_dir / "tmp").iterdir())  # the half-received blob, for now
    started = time.monotonic()
    expect_closed(sock)  # the node gives up on us, we never send the rest
    assert time.monotonic() - started < STALL_TIMEOUT_S + 3
    deadline = time.monotonic() + READ_TIMEOUT_S
    while list((node.data_dir / "tmp").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list((node.data_dir / "tmp").iterdir()) == []
    assert node.client().has([DIGEST]) == set()


def test_stall_mid_header_and_idle_connections_are_timed_out(node: NodeProcess) -> None:
    silent = raw_connection(node)  # never authenticates
    partial = authenticated_connection(node)
    partial.sendall(frame_bytes(b'{"op":"ping"}')[:25])
    started = time.monotonic()
    expect_closed(silent)
    expect_closed(partial)
    assert time.monotonic() - started < STALL_TIMEOUT_S + 3


def test_request_before_auth(node: NodeProcess) -> None:
    sock = raw_connection(node)
    wire.send_frame(sock, {"op": "list"})
    error = expect_error(sock, "unauthorized")
    assert "SMOLTORRENT_CLUSTER_KEY" in error["message"]
    expect_closed(sock)


def test_wrong_key(node: NodeProcess) -> None:
    sock, hello = greeted_connection(node)
    wire.send_frame(sock, auth_frame(b"guessed key", hello, os.urandom(defaults.NONCE_BYTES)))
    expect_error(sock, "unauthorized")
    expect_closed(sock)
    with pytest.raises(AuthenticationError, match="wrong cluster key"):
        NodeClient(node.address, cluster_key=b"guessed key").ping()


def test_missing_key(node: NodeProcess) -> None:
    with pytest.raises(AuthenticationError, match="SMOLTORRENT_CLUSTER_KEY"):
        NodeClient(node.address, cluster_key=None).list_blobs()


def test_replayed_proof_from_another_connection(node: NodeProcess) -> None:
    (first, first_hello), second = greeted_connection(node), raw_connection(node)
    wire.send_frame(second, auth_frame(CLUSTER_KEY, first_hello, os.urandom(32)))
    expect_error(second, "unauthorized")
    first.close()


def test_auth_twice(node: NodeProcess) -> None:
    sock = authenticated_connection(node)
    wire.send_frame(sock, {"op": "auth", "mac": "00" * 32, "nonce": "00" * defaults.NONCE_BYTES})
    expect_error(sock, "bad_request")
    sock.close()


def test_connection_limit_answers_busy(keyless_node: NodeProcess) -> None:
    assert keyless_node.address is not None
    address = (keyless_node.address.host, keyless_node.address.port)
    held = []
    # From several loopback addresses, so the per-address cap is not what bites.
    per_address = defaults.MAX_CONNECTIONS_PER_ADDRESS
    try:
        for index in range(defaults.MAX_CONNECTIONS):
            source = (f"127.0.0.{2 + index // per_address}", 0)
            sock = socket.create_connection(address, READ_TIMEOUT_S, source_address=source)
            assert wire.recv_frame_header(sock)[0]["op"] == "hello"
            held.append(sock)
        extra = socket.create_connection(address, READ_TIMEOUT_S, source_address=("127.0.0.99", 0))
        assert "connections already" in expect_error(extra, "busy")["message"]
        expect_closed(extra)
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + READ_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            assert keyless_node.client().ping()
            break
        except Exception:  # the node frees the slots as it notices the closes
            time.sleep(0.05)
    assert keyless_node.client().ping()


def test_a_peer_trickling_after_its_error_is_closed_within_the_drain_deadline(
    node: NodeProcess,
) -> None:
    """A rejected peer that keeps sending one byte every 0.1 s (each recv of the drain
    getting a byte inside its own timeout) is closed once CLOSE_DRAIN_S has passed in all,
    not after 1 MiB of such bytes: 64 such peers held a host's every slot for good."""
    socks = [raw_connection(node) for _ in range(8)]
    for sock in socks:
        sock.sendall(b"\x00garbage" * 8)  # a whole frame prefix's worth, and wrong
        expect_error(sock, "bad_request")
    open_, deadline = set(socks), time.monotonic() + READ_TIMEOUT_S
    while open_ and time.monotonic() < deadline:
        for sock in list(open_):
            try:
                sock.sendall(b"x")  # once the node has closed, its reset fails a send
            except OSError:
                open_.discard(sock)
                sock.close()
        time.sleep(0.1)
    assert not open_, f"{len(open_)} of 8 trickling peers still held a slot"
