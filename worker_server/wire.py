"""The socket layer shared by the shard server and its clients.

Every read has a timeout (the socket's own), every body is moved through one
fixed buffer or with sendfile, and nothing a peer declares is allocated before
it has been checked against the protocol limits.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import selectors
import socket
from collections.abc import Callable
from typing import Any

from smoltorrent import defaults
from smoltorrent.errors import (
    AuthenticationError,
    FrameTooLargeError,
    PeerClosedError,
    ProtocolError,
    SmoltorrentError,
)
from worker_server import protocol


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection whose every later read and write times out after `timeout` seconds."""
    sock = socket.create_connection((host, port), timeout=min(timeout, defaults.CONNECT_TIMEOUT_S))
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_frame(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    """A whole frame whose body is small enough to hold in memory (JSON, error frames)."""
    sock.sendall(protocol.encode_frame(header, len(body)) + body)


def recv_frame_header(sock: socket.socket) -> tuple[dict[str, Any], int] | None:
    """The next frame's (header, body_len), or None if the peer closed between frames."""
    prefix = _recv_exact_or_eof(sock, protocol.PREFIX_BYTES)
    if prefix is None:
        return None
    header_len, body_len = protocol.decode_prefix(prefix)
    header = protocol.decode_header(recv_exact(sock, header_len))
    return header, body_len


def recv_response(sock: socket.socket, peer: str) -> tuple[dict[str, Any], int]:
    """A response frame's (header, body_len), error frames raised as typed errors."""
    frame = recv_frame_header(sock)
    if frame is None:
        raise PeerClosedError(f"node {peer} closed the connection before answering")
    header, body_len = frame
    return protocol.check_response(header, peer), body_len


def recv_exact(sock: socket.socket, length: int) -> bytes:
    """Exactly `length` bytes; callers bound length before asking."""
    data = _recv_exact_or_eof(sock, length)
    if data is None:
        raise PeerClosedError(f"connection closed before the {length} expected bytes")
    return data


def _recv_exact_or_eof(sock: socket.socket, length: int) -> bytes | None:
    """Exactly `length` bytes, or None if the peer closed before sending any."""
    buffer = bytearray(length)
    view = memoryview(buffer)
    received = 0
    while received < length:
        count = sock.recv_into(view[received:])
        if count == 0:
            if received == 0:
                return None
            raise PeerClosedError(f"connection closed after {received} of {length} expected bytes")
        received += count
    return bytes(buffer)


def recv_json_body(sock: socket.socket, body_len: int, *, what: str = "JSON body") -> Any:
    """A JSON body, refused before reading if it is larger than MAX_JSON_BODY_BYTES."""
    if body_len > defaults.MAX_JSON_BODY_BYTES:
        raise FrameTooLargeError(
            f"{what} of {body_len} bytes is over the {defaults.MAX_JSON_BODY_BYTES} byte limit"
        )
    return protocol.decode_json(recv_exact(sock, body_len), what=what)


def recv_stream(sock: socket.socket, length: int, sink: Callable[[memoryview], None]) -> None:
    """Pass `length` body bytes to sink in chunks of at most IO_CHUNK_BYTES, one buffer reused."""
    buffer = bytearray(min(length, defaults.IO_CHUNK_BYTES))
    view = memoryview(buffer)
    remaining = length
    while remaining:
        count = sock.recv_into(view[: min(remaining, len(buffer))])
        if count == 0:
            raise PeerClosedError(
                f"connection closed after {length - remaining} of {length} body bytes"
            )
        sink(view[:count])
        remaining -= count


def recv_to_file(
    sock: socket.socket,
    length: int,
    fd: int,
    offset: int,
    *,
    skip: int = 0,
    limit: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> str:
    """Stream a body to fd at offset (after hashing-only its first `skip` bytes); its SHA-256.

    With `limit`, nothing is written at or past offset + limit: a body longer than
    announced raises ProtocolError before its excess reaches the file.
    """
    hasher = hashlib.sha256()
    position = 0  # bytes of the body seen so far

    def write(chunk: memoryview) -> None:
        nonlocal position
        hasher.update(chunk)
        start = max(skip - position, 0)
        if limit is not None and position + len(chunk) - skip > limit:
            raise ProtocolError(
                f"body of {length} bytes runs past the {limit} bytes its range may hold"
            )
        if start < len(chunk):
            try:
                _pwrite_all(fd, chunk[start:], offset + position + start - skip)
            except OSError as exc:
                # Not the peer's fault: keep it apart from the network errors callers map.
                raise SmoltorrentError(
                    f"cannot write the received data to the output file: {exc}"
                ) from exc
        position += len(chunk)
        if progress is not None:
            progress(len(chunk))

    recv_stream(sock, length, write)
    return hasher.hexdigest()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def send_file_range(sock: socket.socket, fd: int, offset: int, count: int) -> None:
    """Send `count` bytes of fd from offset with sendfile, waiting at most the socket's timeout."""
    timeout = sock.gettimeout()
    sent_total = 0
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_WRITE)
        while sent_total < count:
            chunk = min(count - sent_total, defaults.SENDFILE_MAX_BYTES)
            try:
                sent = os.sendfile(sock.fileno(), fd, offset + sent_total, chunk)
            except BlockingIOError:
                # A socket with a timeout is non-blocking underneath: wait until it drains.
                if not selector.select(timeout):
                    raise TimeoutError(f"peer stopped reading for {timeout} s") from None
                continue
            if sent == 0:
                raise ProtocolError(
                    f"source file ended {count - sent_total} bytes before the declared length"
                )
            sent_total += sent


def close_after_error(sock: socket.socket) -> None:
    """Close so the peer can still read our error frame (unread input would make it a reset)."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(defaults.CLOSE_DRAIN_S)
        drained = 0
        while drained < defaults.CLOSE_DRAIN_BYTES:
            chunk = sock.recv(defaults.IO_CHUNK_BYTES)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass  # the peer is gone already; closing is all that is left to do
    finally:
        sock.close()


def new_nonce() -> bytes:
    return secrets.token_bytes(defaults.NONCE_BYTES)


def server_handshake(sock: socket.socket, node_id: str, cluster_key: bytes | None) -> None:
    """Greet the client and, with a key, run the mutual HMAC challenge-response.

    Raises AuthenticationError after sending an `unauthorized` error frame; the
    caller closes the connection.
    """
    server_nonce = new_nonce()
    send_frame(
        sock,
        {
            "op": "hello",
            "protocol": defaults.PROTOCOL_VERSION,
            "node_id": node_id,
            "auth": protocol.AUTH_HMAC if cluster_key else protocol.AUTH_NONE,
            "nonce": server_nonce.hex(),
        },
    )
    if not cluster_key:
        return
    frame = recv_frame_header(sock)
    if frame is None:
        raise AuthenticationError("client left before authenticating")
    header, body_len = frame
    if header.get("op") != "auth":
        message = (
            "this node requires the cluster key: set SMOLTORRENT_CLUSTER_KEY"
            " (or --cluster-key) to the key the node was started with"
        )
        send_frame(sock, protocol.error_header("unauthorized", message))
        raise AuthenticationError(f"request {header.get('op')!r} before authentication")
    request = protocol.validate_request(header, body_len)
    if not protocol.proofs_match(protocol.client_proof(cluster_key, server_nonce), request["mac"]):
        message = "wrong cluster key: use the same SMOLTORRENT_CLUSTER_KEY on every machine"
        send_frame(sock, protocol.error_header("unauthorized", message))
        raise AuthenticationError("client proof does not match the cluster key")
    proof = protocol.server_proof(cluster_key, bytes.fromhex(request["nonce"]))
    send_frame(sock, {"ok": True, "mac": proof})


def client_handshake(sock: socket.socket, cluster_key: bytes | None, peer: str) -> str:
    """Read the node's hello and authenticate both ways if it asks for a key; its node id."""
    frame = recv_frame_header(sock)
    if frame is None:
        raise PeerClosedError(f"node {peer} closed the connection before greeting")
    if frame[0].get("ok") is False:  # a node at its connection limit answers `busy` instead
        protocol.check_response(frame[0], peer)
    hello = protocol.validate_hello(frame[0])
    if hello["auth"] == protocol.AUTH_NONE:
        if cluster_key:
            raise AuthenticationError(
                f"node {peer} has no cluster key; start it with --cluster-key (or"
                " SMOLTORRENT_CLUSTER_KEY) so nobody else can read or write it"
            )
        return hello["node_id"]
    if not cluster_key:
        raise AuthenticationError(
            f"node {peer} requires the cluster key: set SMOLTORRENT_CLUSTER_KEY to the key"
            " the node was started with"
        )
    client_nonce = new_nonce()
    mac = protocol.client_proof(cluster_key, hello["nonce"])
    send_frame(sock, {"op": "auth", "mac": mac, "nonce": client_nonce.hex()})
    header, _ = recv_response(sock, peer)
    if not protocol.proofs_match(
        protocol.server_proof(cluster_key, client_nonce), header.get("mac")
    ):
        raise AuthenticationError(
            f"node {peer} could not prove it holds the cluster key: it was started with a"
            " different key, or something else answers at that address"
        )
    return hello["node_id"]


def send_put(
    sock: socket.socket, peer: str, digest: str, prefix: bytes, fd: int, offset: int, length: int
) -> bool:
    """The client half of a two-phase put; True if stored, False if the node already had it."""
    size = len(prefix) + length
    sock.sendall(protocol.encode_frame({"op": "put", "digest": digest, "size": size}, size))
    header, _ = recv_response(sock, peer)
    if header.get("status") == "exists":
        return False
    if header.get("status") != "continue":
        raise ProtocolError(f"node {peer} answered a put with {header!r}")
    sock.sendall(prefix)
    send_file_range(sock, fd, offset, length)
    header, _ = recv_response(sock, peer)
    if header.get("status") != "stored":
        raise ProtocolError(f"node {peer} did not confirm the put: {header!r}")
    return True
