"""The socket layer shared by the shard server and its clients.

Every read has a timeout (the socket's own), every body is moved through one
fixed buffer or with sendfile, and nothing a peer declares is allocated before
it has been checked against the protocol limits.

After a keyed handshake the socket carries its FrameAuth, and every frame
sent or received through this module is tagged and checked (see protocol.py).
A body may travel untagged only where the receiver checks a content digest
(a put's blob, a whole-blob get): the receiver says so with digest_covered.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from smoltorrent import defaults
from smoltorrent.errors import (
    AuthenticationError,
    FrameTooLargeError,
    PeerClosedError,
    ProtocolError,
    SmoltorrentError,
)
from worker_server import protocol, writeback


class FrameAuth:
    """One authenticated session's frame keys and sequence numbers, one per direction."""

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = 0  # frames sent so far: the next one's sequence number
        self._received = 0
        self._body_mac: hmac.HMAC | None = None  # the tagged body being received, if any

    def seal(self, frame_head: bytes) -> bytes:
        """The tag for the next frame sent (prefix + header bytes)."""
        tag = protocol.header_tag(self._send_key, self._sent, frame_head)
        self._sent += 1
        return tag

    def body_mac(self, head_tag: bytes) -> hmac.HMAC:
        return protocol.body_mac(self._send_key, head_tag)

    def open(self, frame_head: bytes, tag: bytes, flags: int, body_len: int) -> None:
        """Check the tag of the next frame received; AuthenticationError if it fails."""
        expected = protocol.header_tag(self._recv_key, self._received, frame_head)
        if not protocol.tags_match(expected, tag):
            raise AuthenticationError(
                f"frame {self._received} of this connection failed its integrity check:"
                " something between the two ends changed, dropped, replayed or reordered it"
            )
        self._received += 1
        tagged_body = bool(flags & protocol.FLAG_BODY_TAG)
        if tagged_body and body_len == 0:
            raise ProtocolError("frame flags a body tag but declares no body")
        self._body_mac = protocol.body_mac(self._recv_key, tag) if tagged_body else None

    def take_body_mac(self) -> hmac.HMAC | None:
        mac, self._body_mac = self._body_mac, None
        return mac


class SessionSocket(socket.socket):
    """A TCP socket that carries its session's FrameAuth once a keyed handshake set it,
    and a deadline that bounds a whole exchange, not just each read."""

    frame_auth: FrameAuth | None = None
    deadline: float | None = None  # time.monotonic() by which reads must be done

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer did not finish in time")
            self.settimeout(min(remaining, self._timeout_outside_deadline))
        limit = self.gettimeout()
        if limit is None or limit <= defaults.STALL_CHECK_S:
            return super().recv_into(buffer, nbytes, flags)
        # Waited in steps: between them the kernel says whether the peer's host still
        # acknowledges what we sent it (a handshake, a body's tail): an unplugged node is
        # given up after STALL_S, while a node that took every byte and is still working
        # (an fsync, a re-hash) keeps the whole timeout, as it owes us nothing yet.
        waited = 0.0
        try:
            while True:
                step = min(defaults.STALL_CHECK_S, limit - waited)
                self.settimeout(step)
                try:
                    return super().recv_into(buffer, nbytes, flags)
                except TimeoutError:
                    waited += step
                    if waited >= limit:
                        raise
                    if peer_unacknowledging(self):
                        raise TimeoutError(_STALLED) from None
        finally:
            self.settimeout(limit)

    _timeout_outside_deadline: float = defaults.SOCKET_TIMEOUT_S


@contextlib.contextmanager
def deadline(sock: SessionSocket, seconds: float) -> Iterator[None]:
    """Every read inside must be done `seconds` from now, however the peer trickles bytes."""
    timeout = sock.gettimeout()
    sock._timeout_outside_deadline = defaults.SOCKET_TIMEOUT_S if timeout is None else timeout
    sock.deadline = time.monotonic() + seconds
    try:
        yield
    finally:
        sock.deadline = None
        sock.settimeout(timeout)


def quiet(sock: socket.socket) -> bool:
    """Nothing to read on an idle kept connection: one the peer closed (its idle timeout, a
    restart) reads as its end, and is not to be reused."""
    # One poll(2) call: a selector would create and close an epoll instance per reuse.
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)


def session_socket(sock: socket.socket) -> SessionSocket:
    """The same connection as a SessionSocket (the old object is detached, not closed),
    each write sent at once (no Nagle)."""
    if isinstance(sock, SessionSocket):
        return sock
    timeout = sock.gettimeout()
    wrapped = SessionSocket(sock.family, sock.type, sock.proto, fileno=sock.detach())
    wrapped.settimeout(timeout)
    if wrapped.family in (socket.AF_INET, socket.AF_INET6):
        # A node answers a get with a small frame header, then the blob by sendfile. With
        # Nagle on, the body's last short segment waits for the ACK of what went before,
        # which the reader of a request-and-answer connection delays (~40 ms on Linux):
        # once per blob, so a gather's chunks each waited it on the node's side.
        wrapped.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return wrapped


def _auth(sock: socket.socket) -> FrameAuth | None:
    return getattr(sock, "frame_auth", None)


def connect(host: str, port: int, timeout: float) -> SessionSocket:
    """A TCP connection whose every later read and write times out after `timeout` seconds."""
    sock = socket.create_connection((host, port), timeout=min(timeout, defaults.CONNECT_TIMEOUT_S))
    wrapped = session_socket(sock)
    wrapped.settimeout(timeout)
    return wrapped


def send_frame(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    """A whole frame whose body is small enough to hold in memory (JSON, error frames)."""
    auth = _auth(sock)
    if auth is None:
        sock.sendall(protocol.encode_frame(header, len(body)) + body)
        return
    head = protocol.encode_frame(header, len(body), protocol.FLAG_BODY_TAG if body else 0)
    tag = auth.seal(head)
    body_tag = auth.body_mac(tag) if body else None
    if body_tag is None:
        sock.sendall(head + tag)
        return
    body_tag.update(body)
    sock.sendall(head + tag + body + body_tag.digest())


def send_frame_header(sock: socket.socket, header: dict[str, Any], body_len: int) -> None:
    """A frame whose body the caller sends next, raw and untagged: only for a body the
    receiver checks against a content digest (a put's blob, a whole blob answering a get)."""
    head = protocol.encode_frame(header, body_len)
    auth = _auth(sock)
    sock.sendall(head if auth is None else head + auth.seal(head))


def send_file_frame(
    sock: socket.socket,
    header: dict[str, Any],
    fd: int,
    offset: int,
    length: int,
    *,
    digest_covered: bool,
) -> None:
    """A frame whose body is `length` bytes of fd: sendfile when the receiver checks a
    digest or there is no key, else read, tagged and sent through one buffer."""
    auth = _auth(sock)
    if auth is None or digest_covered or length == 0:
        send_frame_header(sock, header, length)
        send_file_range(sock, fd, offset, length)
        return
    head = protocol.encode_frame(header, length, protocol.FLAG_BODY_TAG)
    tag = auth.seal(head)
    mac = auth.body_mac(tag)
    sock.sendall(head + tag)
    position = offset
    while position < offset + length:
        chunk = os.pread(fd, min(defaults.IO_CHUNK_BYTES, offset + length - position), position)
        if not chunk:
            raise ProtocolError(
                f"source file ended {offset + length - position} bytes before the declared length"
            )
        mac.update(chunk)
        sock.sendall(chunk)
        position += len(chunk)
    sock.sendall(mac.digest())


def recv_frame_header(sock: socket.socket) -> tuple[dict[str, Any], int] | None:
    """The next frame's (header, body_len), or None if the peer closed between frames."""
    prefix = _recv_exact_or_eof(sock, protocol.PREFIX_BYTES)
    if prefix is None:
        return None
    header_len, body_len, flags = protocol.decode_prefix_flags(prefix)
    header_bytes = recv_exact(sock, header_len)
    auth = _auth(sock)
    if auth is not None:
        auth.open(prefix + header_bytes, recv_exact(sock, protocol.TAG_BYTES), flags, body_len)
    elif flags:
        raise ProtocolError(f"frame flags {flags} on a connection without a cluster key")
    return protocol.decode_header(header_bytes), body_len


def recv_response(sock: socket.socket, peer: str) -> tuple[dict[str, Any], int]:
    """A response frame's (header, body_len), error frames raised as typed errors."""
    frame = recv_frame_header(sock)
    if frame is None:
        raise PeerClosedError(f"node {peer} closed the connection before answering")
    header, body_len = frame
    return protocol.check_response(header, peer), body_len


def recv_final_response(
    sock: socket.socket, peer: str, on_progress: Callable[[int], None] | None = None
) -> tuple[dict[str, Any], int]:
    """The answer to a long request, after any progress frames the node sent while working.

    A node copying or re-hashing a large blob sends {"ok": true, "progress": bytes} now and
    then, so each read waits one socket timeout: a slow node is told from a dead one.
    """
    while True:
        header, body_len = recv_response(sock, peer)
        if "progress" not in header:
            return header, body_len
        if on_progress is not None:
            on_progress(protocol.validate_length(header["progress"], "progress"))


def progress_ticker(sock: socket.socket, interval: float) -> Callable[[int], None]:
    """tick(done): sends a progress frame on sock when `interval` seconds have passed."""
    last = time.monotonic()

    def tick(done: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= interval:
            last = now
            send_frame(sock, {"ok": True, "progress": done})

    return tick


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


def _body_mac(sock: socket.socket, length: int, digest_covered: bool) -> hmac.HMAC | None:
    """The running MAC a body must match, None if it carries no tag (refused unless
    the caller checks the body against a content digest itself)."""
    auth = _auth(sock)
    if auth is None:
        return None
    mac = auth.take_body_mac()
    if mac is None and length and not digest_covered:
        raise AuthenticationError(
            "a body arrived without its integrity tag on an authenticated connection"
        )
    return mac


def _check_body_tag(sock: socket.socket, mac: hmac.HMAC | None) -> None:
    if mac is not None and not protocol.tags_match(
        mac.digest(), recv_exact(sock, protocol.TAG_BYTES)
    ):
        raise AuthenticationError(
            "a frame body failed its integrity check: something between the two ends changed it"
        )


def recv_body(sock: socket.socket, length: int) -> bytes:
    """A whole in-memory body (its tag checked on a keyed connection); callers bound length."""
    mac = _body_mac(sock, length, digest_covered=False)
    body = recv_exact(sock, length) if length else b""
    if mac is not None:
        mac.update(body)
    _check_body_tag(sock, mac)
    return body


def recv_json_body(sock: socket.socket, body_len: int, *, what: str = "JSON body") -> Any:
    """A JSON body, refused before reading if it is larger than MAX_JSON_BODY_BYTES."""
    if body_len > defaults.MAX_JSON_BODY_BYTES:
        raise FrameTooLargeError(
            f"{what} of {body_len} bytes is over the {defaults.MAX_JSON_BODY_BYTES} byte limit"
        )
    return protocol.decode_json(recv_body(sock, body_len), what=what)


def recv_stream(
    sock: socket.socket,
    length: int,
    sink: Callable[[memoryview], None],
    *,
    digest_covered: bool = False,
    pace: Callable[[int], None] | None = None,
    slice_bytes: int | None = defaults.BWLIMIT_SLICE_BYTES,
) -> None:
    """Pass `length` body bytes to sink in chunks of at most IO_CHUNK_BYTES, one buffer reused.

    digest_covered: the caller checks the bytes against a content digest, so on a keyed
    connection the body may come without a tag. pace(n), when given, is told of every
    slice received (at most slice_bytes; None: as large as without pace, for a meter that
    only counts) and may wait: a bandwidth limit."""
    mac = _body_mac(sock, length, digest_covered)
    step = min(length, defaults.IO_CHUNK_BYTES)
    if pace is not None and slice_bytes is not None:
        step = min(step, slice_bytes)
    remaining = length
    with _thread_buffer(step) as view:
        while remaining:
            count = sock.recv_into(view[: min(remaining, step)])
            if count == 0:
                raise PeerClosedError(
                    f"connection closed after {length - remaining} of {length} body bytes"
                )
            if mac is not None:
                mac.update(view[:count])
            sink(view[:count])
            remaining -= count
            if pace is not None:
                pace(count)
    _check_body_tag(sock, mac)


_buffers = threading.local()


@contextlib.contextmanager
def _thread_buffer(size: int) -> Iterator[memoryview]:
    """A receive buffer of at least `size` bytes (at most IO_CHUNK_BYTES), this thread's
    own and reused from one body to the next: a gather receives hundreds of chunks per GB
    per thread, and a fresh IO_CHUNK_BYTES buffer each time was zeroed and faulted in
    again. A body received inside another one's sink (none today) gets a buffer of its
    own."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = bytearray(size)
    _buffers.buffer = None  # taken: a nested receive in this thread allocates its own
    try:
        yield memoryview(buffer)
    finally:
        _buffers.buffer = buffer


def recv_to_file(
    sock: socket.socket,
    length: int,
    fd: int,
    offset: int,
    *,
    skip: int = 0,
    limit: int | None = None,
    progress: Callable[[int], None] | None = None,
    pace: Callable[[int], None] | None = None,
    slice_bytes: int | None = defaults.BWLIMIT_SLICE_BYTES,
) -> str:
    """Stream a body to fd at offset (after hashing-only its first `skip` bytes); its SHA-256.
    pace, slice_bytes: as for recv_stream.

    With `limit`, nothing is written at or past offset + limit: a body longer than
    announced raises ProtocolError before its excess reaches the file.
    """
    hasher = hashlib.sha256()
    position = 0  # bytes of the body seen so far
    # The disk writes while the rest arrives: the caller's fsync finds little left.
    trail = writeback.Trail(fd, offset)

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
            trail.wrote(offset + position + len(chunk) - skip)
        position += len(chunk)
        if progress is not None:
            progress(len(chunk))

    # The caller compares the result with the digest it asked for.
    recv_stream(sock, length, write, digest_covered=True, pace=pace, slice_bytes=slice_bytes)
    return hasher.hexdigest()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def send_file_range(
    sock: socket.socket,
    fd: int,
    offset: int,
    count: int,
    progress: Callable[[int], None] | None = None,
    pace: Callable[[int], None] | None = None,
    slice_bytes: int | None = defaults.BWLIMIT_SLICE_BYTES,
) -> None:
    """Send `count` bytes of fd from offset with sendfile, waiting at most the socket's timeout
    for each step; progress(bytes sent so far) after each step. With pace, each sendfile
    moves at most slice_bytes and pace(n) is told of the n sent (it may wait); slice_bytes
    None: as large as without pace, for a meter that only counts."""
    timeout = sock.gettimeout()
    step = defaults.SENDFILE_MAX_BYTES
    if pace is not None and slice_bytes is not None:
        step = slice_bytes
    sent_total = 0
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_WRITE)
        while sent_total < count:
            # Never 0: macOS's sendfile reads a count of 0 as "to the end of the file". A
            # partial send there (EAGAIN after some bytes) returns its count, as on Linux.
            chunk = min(count - sent_total, step)
            try:
                sent = os.sendfile(sock.fileno(), fd, offset + sent_total, chunk)
            except BlockingIOError:
                # A socket with a timeout is non-blocking underneath: wait until it drains.
                wait_writable(sock, selector, timeout)
                continue
            if sent == 0:
                raise ProtocolError(
                    f"source file ended {count - sent_total} bytes before the declared length"
                )
            sent_total += sent
            if pace is not None:
                pace(sent)
            if progress is not None:
                progress(sent_total)


def send_prefix(
    sock: socket.socket, prefix: bytes, pace: Callable[[int], None] | None = None
) -> None:
    """A blob's own header, before its range goes by sendfile; told to pace like the range."""
    sock.sendall(prefix)
    if pace is not None and prefix:
        pace(len(prefix))


def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """sock.sendall(data), giving up on a peer whose host stopped acknowledging after
    STALL_S rather than after the whole socket timeout (see wait_writable)."""
    view = memoryview(data)
    while view:
        try:
            # A socket with a timeout is non-blocking underneath; its own send() would wait
            # out the timeout inside, so the fd is written directly.
            view = view[os.write(sock.fileno(), view) :]
        except BlockingIOError:
            with selectors.DefaultSelector() as selector:  # only once the buffer is full
                selector.register(sock, selectors.EVENT_WRITE)
                wait_writable(sock, selector, sock.gettimeout())


def wait_writable(
    sock: socket.socket, selector: selectors.BaseSelector, timeout: float | None
) -> None:
    """Until sock can take more bytes: at most `timeout` seconds for a peer that reads
    slowly (a busy node; a chain whose next node is slow), but only about STALL_S once its
    host stops acknowledging at all (unplugged, powered off: packets vanish, no reset), so
    a lost node's replica moves to another node in seconds, not a whole socket timeout."""
    step = defaults.STALL_CHECK_S if timeout is None else min(timeout, defaults.STALL_CHECK_S)
    waited = 0.0
    while not selector.select(step):
        waited += step
        if timeout is not None and waited >= timeout:
            raise TimeoutError(f"peer stopped reading for {timeout} s")
        if peer_unacknowledging(sock):
            raise TimeoutError(_STALLED)


_STALLED = f"peer acknowledged nothing for {defaults.STALL_S:g} s: its host or link is down"

# struct tcp_info (linux/tcp.h): tcpi_retransmits and tcpi_probes are bytes 2 and 3,
# tcpi_last_ack_recv (ms) the u32 at byte 56; stable since Linux 2.6.
_TCP_INFO_BYTES = 104
_LAST_ACK_RECV_AT = 56


def peer_unacknowledging(sock: socket.socket) -> bool:
    """True when the kernel says the peer's host stopped acknowledging what we send: our
    retransmissions or window probes go unanswered and no ACK came for STALL_S. A peer that
    is alive but not reading still answers window probes, so it is not. False wherever the
    kernel does not tell (not Linux): there only the socket timeout applies."""
    option = getattr(socket, "TCP_INFO", None)
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO_BYTES) if option else b""
    except OSError:
        return False
    if len(info) < _LAST_ACK_RECV_AT + 4:
        return False
    unanswered = info[2] + info[3]  # retransmissions, then zero-window probes, in a row
    (since_last_ack_ms,) = struct.unpack_from("=I", info, _LAST_ACK_RECV_AT)
    return unanswered >= defaults.STALL_UNANSWERED and since_last_ack_ms >= defaults.STALL_S * 1000


def close_after_error(sock: socket.socket) -> None:
    """Close so the peer can still read our error frame (unread input would make it a reset).
    The drain has one deadline in all, not one per read: a peer trickling a byte inside each
    read's timeout would otherwise hold its connection slot for a MiB of such bytes."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + defaults.CLOSE_DRAIN_S
        drained = 0
        while drained < defaults.CLOSE_DRAIN_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
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
    """Greet the client and, with a key, run the mutual HMAC challenge-response, then
    key every later frame of this connection.

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
            "this node requires the cluster key: copy the key file the node was started"
            " with to ~/.smoltorrent/cluster.key here (or set SMOLTORRENT_CLUSTER_KEY_FILE)"
        )
        send_frame(sock, protocol.error_header("unauthorized", message))
        raise AuthenticationError(f"request {header.get('op')!r} before authentication")
    request = protocol.validate_request(header, body_len)
    client_nonce = bytes.fromhex(request["nonce"])
    expected = protocol.client_proof(cluster_key, server_nonce, client_nonce, node_id)
    if not protocol.proofs_match(expected, request["mac"]):
        message = "wrong cluster key: use the same cluster key file on every machine"
        send_frame(sock, protocol.error_header("unauthorized", message))
        raise AuthenticationError("client proof does not match the cluster key")
    proof = protocol.server_proof(cluster_key, server_nonce, client_nonce, node_id)
    send_frame(sock, {"ok": True, "mac": proof})
    to_server, to_client = protocol.session_keys(cluster_key, server_nonce, client_nonce, node_id)
    _set_auth(sock, FrameAuth(send_key=to_client, recv_key=to_server))


def client_handshake(sock: socket.socket, cluster_key: bytes | None, peer: str) -> str:
    """Read the node's hello and authenticate both ways if it asks for a key; its node id.

    Nothing that acts is sent before the node has proved it holds the key: the
    client's own proof is bound to this connection's nonces and cannot be replayed.
    """
    frame = recv_frame_header(sock)
    if frame is None:
        raise PeerClosedError(f"node {peer} closed the connection before greeting")
    if frame[0].get("ok") is False:  # a node at its connection limit answers `busy` instead
        protocol.check_response(frame[0], peer)
    hello = protocol.validate_hello(frame[0])
    if hello["auth"] == protocol.AUTH_NONE:
        if cluster_key:
            raise AuthenticationError(
                f"node {peer} has no cluster key; start it with --key-file (the file"
                " `smoltorrent init` wrote) so nobody else can read or write it"
            )
        return hello["node_id"]
    if not cluster_key:
        raise AuthenticationError(
            f"node {peer} requires the cluster key: copy the key file the node was started"
            " with to ~/.smoltorrent/cluster.key on this machine (or set"
            " SMOLTORRENT_CLUSTER_KEY_FILE to its path)"
        )
    server_nonce, node_id = hello["nonce"], hello["node_id"]
    client_nonce = new_nonce()
    mac = protocol.client_proof(cluster_key, server_nonce, client_nonce, node_id)
    send_frame(sock, {"op": "auth", "mac": mac, "nonce": client_nonce.hex()})
    header, _ = recv_response(sock, peer)
    expected = protocol.server_proof(cluster_key, server_nonce, client_nonce, node_id)
    if not protocol.proofs_match(expected, header.get("mac")):
        raise AuthenticationError(
            f"node {peer} could not prove it holds the cluster key: it was started with a"
            " different key, or something else answers at that address"
        )
    to_server, to_client = protocol.session_keys(cluster_key, server_nonce, client_nonce, node_id)
    _set_auth(sock, FrameAuth(send_key=to_server, recv_key=to_client))
    return node_id


def _set_auth(sock: socket.socket, auth: FrameAuth) -> None:
    if not isinstance(sock, SessionSocket):
        raise TypeError("a keyed handshake needs a SessionSocket: use wire.session_socket(sock)")
    sock.frame_auth = auth


def send_put(
    sock: socket.socket,
    peer: str,
    digest: str,
    prefix: bytes,
    fd: int,
    offset: int,
    length: int,
    progress: Callable[[int], None] | None = None,
    pace: Callable[[int], None] | None = None,
    slice_bytes: int | None = defaults.BWLIMIT_SLICE_BYTES,
) -> bool:
    """The client half of a two-phase put; True if stored, False if the node already had it.

    progress(n) runs as body bytes leave and as the node reports re-hashing a copy it has;
    pace(n) and slice_bytes as for send_file_range.
    """
    size = len(prefix) + length
    # The node checks the blob against its digest, so the body goes untagged (sendfile).
    send_frame_header(sock, {"op": "put", "digest": digest, "size": size}, size)
    header, _ = recv_final_response(sock, peer, progress)
    if header.get("status") == "exists":
        return False
    if header.get("status") != "continue":
        raise ProtocolError(f"node {peer} answered a put with {header!r}")
    send_prefix(sock, prefix, pace)
    send_file_range(sock, fd, offset, length, progress, pace, slice_bytes)
    header, _ = recv_final_response(sock, peer, progress)
    if header.get("status") != "stored":
        raise ProtocolError(f"node {peer} did not confirm the put: {header!r}")
    return True
