"""Chain replication on a node: keep a blob and pass it on to the next node as it arrives.

A chain_put names the nodes after this one (`forward`). Before it asks its sender
for the body, the node opens a chain_put to the first of them that answers; every
chunk then goes to its own temp file and on to that next node in the same pass,
through the one receive buffer, so the blob crosses each link once and memory
stays flat. Each node verifies its own copy, and the final answers flow back up
the chain: every node reports itself and every node after it, in order.

A next node that cannot be reached is reported and skipped for the one after it;
one that breaks off mid-blob is reported, and once this node holds its own
verified copy it pushes that copy to the nodes the broken link cut off. Nothing
here ever fails the upstream because of a downstream node: the sender always
gets a report.

A link that ended in step (the next node's report read, every byte it asked for
sent) is kept by the session for the next chain_put on the same connection: a
chain task sends its whole batch of chunks over one connection to the head, and
a new link per chunk cost the next node a TCP accept, the key handshake and a
thread each time.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from smoltorrent import defaults
from smoltorrent.errors import (
    AuthenticationError,
    DigestMismatchError,
    DiskFullError,
    DiskIOError,
    NodeError,
    NotFoundError,
    PeerClosedError,
    ProtocolError,
    SmoltorrentError,
)
from worker_server import protocol, wire

log = logging.getLogger(__name__)

Hop = tuple[str, int]  # (host, port) of a node further down the chain
Tick = Callable[[int], None]  # keeps our own sender's wait alive while we wait downstream


def error_code(exc: BaseException) -> str:
    """The wire error code that best names why a node in a chain failed."""
    if isinstance(exc, NodeError):
        return exc.code
    if isinstance(exc, DigestMismatchError):
        return "digest_mismatch"
    if isinstance(exc, DiskFullError):
        return "disk_full"
    if isinstance(exc, DiskIOError):
        return "disk_error"
    if isinstance(exc, AuthenticationError):
        return "unauthorized"
    if isinstance(exc, NotFoundError):
        return "not_found"
    if isinstance(exc, (OSError, PeerClosedError)):
        return "peer_unavailable"
    if isinstance(exc, ProtocolError):
        return "bad_request"
    return "internal"


class Keepalive:
    """Progress frames to our own sender every `interval` seconds from a thread of its own,
    for as long as a chain_put runs: however long the nodes after us take to answer, or
    to time out, our sender hears from us, so only a node that is itself stuck is given up.
    Every frame to the sender goes through send(), under one lock (frame tags are numbered).

    One per session, its thread started at the first chain_put and kept for the next ones
    (a chain task sends its whole batch over one connection): a thread started and joined
    per blob cost a node ~0.25 ms of CPU each time, more than the rest of its Python per
    blob. Between chain_puts the thread sleeps and sends nothing."""

    def __init__(self, sock: socket.socket, interval: float) -> None:
        self._sock = sock
        self._interval = interval
        self._lock = threading.Condition()
        self._active = False  # a chain_put runs: frames are due
        self._due = 0.0  # monotonic time of the next progress frame
        self._closed = False
        self._parked = False  # the thread waits with no timeout: only a notify wakes it
        self._thread: threading.Thread | None = None
        self.progress = 0  # bytes received so far, reported as is

    @contextlib.contextmanager
    def running(self) -> Iterator[Keepalive]:
        """Frames every interval while the block runs (one chain_put), none after it."""
        with self._lock:
            self.progress = 0
            self._active = True
            self._due = time.monotonic() + self._interval
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="chain-keepalive", daemon=True
                )
                self._thread.start()
            elif self._parked:
                # Only a parked thread needs waking. One in a timed wait (a chain_put ended
                # less than an interval ago) wakes by itself no later than this new due
                # time, so a batch of chain_puts wakes it about once per interval, not
                # once per blob (each wake-up two context switches on the node).
                self._lock.notify()
        try:
            yield self
        finally:
            with self._lock:  # a frame being sent finishes first: none goes out after this
                self._active = False

    def close(self) -> None:
        """Stop the thread for good (the session ends)."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def send(self, header: dict[str, Any]) -> None:
        with self._lock:
            wire.send_frame(self._sock, header)

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._active:
                    self._parked = True
                    self._lock.wait()
                    self._parked = False
                    continue
                wait = self._due - time.monotonic()
                if wait > 0:
                    self._lock.wait(wait)
                    continue
                self._due += self._interval
                try:
                    wire.send_frame(self._sock, {"ok": True, "progress": self.progress})
                except OSError:
                    # The sender is gone; the main thread finds out on its next read. A
                    # later chain_put here (if any) starts a thread afresh.
                    self._thread = None
                    return


class KeptLinks:
    """The idle link a session keeps to the next node of its chains, for its next
    chain_put; at most one, so a session holds no more than one connection downstream,
    idle or busy. Used by the session's own thread only."""

    def __init__(self) -> None:
        self._idle: tuple[Hop, socket.socket, str] | None = None

    def take(self, hop: Hop) -> tuple[socket.socket, str] | None:
        """(the kept connection to hop, the node id its handshake proved), or None."""
        idle, self._idle = self._idle, None
        if idle is None:
            return None
        kept_hop, sock, node_id = idle
        if kept_hop == hop and wire.quiet(sock):
            return sock, node_id
        # Another next node, or one that closed it while it sat idle (its timeout, a restart).
        _close(sock)
        return None

    def give(self, hop: Hop, sock: socket.socket, node_id: str) -> None:
        self.close()
        self._idle = (hop, sock, node_id)

    def close(self) -> None:
        idle, self._idle = self._idle, None
        if idle is not None:
            _close(idle[1])


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def unreached(hops: list[Hop], why: str) -> list[dict[str, Any]]:
    return [
        protocol.chain_entry(protocol.CHAIN_FAILED, None, "peer_unavailable", why) for _ in hops
    ]


class Link:
    """An open chain_put to the next node that answered, and the nodes it serves after it.

    streaming: the next node said "continue" and takes the body from us; otherwise it
    said "exists" and passes its own copy on, and we only collect its report.
    """

    def __init__(
        self, sock: socket.socket, peer: str, node_id: str, hops: list[Hop], streaming: bool
    ) -> None:
        self.sock, self.peer, self.node_id = sock, peer, node_id
        self.hops = hops  # this next node first, then the ones it forwards to
        self.streaming = streaming
        self.broken: str | None = None  # why the body stopped reaching it
        self.sent = 0
        self._kept = False  # handed to a KeptLinks: no longer ours to close

    def send(self, chunk: memoryview) -> None:
        """Pass a chunk on; a failure only marks the link broken (our own copy goes on)."""
        if not self.streaming or self.broken is not None:
            return
        try:
            wire.send_all(self.sock, chunk)
            self.sent += len(chunk)
        except OSError as exc:
            self._break(f"the link to {self.peer} broke after {self.sent} bytes ({exc})")

    def send_file(self, fd: int, size: int) -> None:
        if not self.streaming:
            return
        try:
            wire.send_file_range(self.sock, fd, 0, size)
            self.sent = size
        except (OSError, ProtocolError) as exc:
            self._break(f"the link to {self.peer} broke while pushing our copy ({exc})")

    def _break(self, why: str) -> None:
        self.broken = why
        log.warning("chain: %s", why)
        self.close()

    def close(self) -> None:
        if not self._kept:
            _close(self.sock)

    def finish(
        self, tick: Tick, timeout: float, kept: KeptLinks | None = None
    ) -> tuple[list[dict[str, Any]], int | None]:
        """(one entry per hop of this link, the index in self.hops from which nodes were cut
        off by a broken link and may still take our copy, or None). With `kept`, a link
        whose report came back whole is left there for the next chain_put."""
        if self.broken is not None:
            entry = protocol.chain_entry(
                protocol.CHAIN_FAILED, self.node_id, "peer_unavailable", self.broken
            )
            return [entry, *unreached(self.hops[1:], self.broken)], 1
        try:
            # It sends progress at a quarter of its timeout; silence for half of ours is death.
            self.sock.settimeout(timeout * defaults.CHAIN_DOWNSTREAM_TIMEOUT_SHARE)
            header, _ = wire.recv_final_response(self.sock, self.peer, tick)
            report = protocol.validate_chain_report(header, len(self.hops) - 1)
        except (OSError, SmoltorrentError) as exc:
            why = f"{self.peer} sent no chain report ({exc})"
            log.warning("chain: %s", why)
            entry = protocol.chain_entry(protocol.CHAIN_FAILED, self.node_id, error_code(exc), why)
            self.close()
            return [entry, *unreached(self.hops[1:], why)], 1
        # In step: it read every byte it asked for before it reported.
        if kept is not None:
            kept.give(self.hops[0], self.sock, self.node_id)
            self._kept = True
        else:
            self.close()
        own = {**report["self"], "node_id": self.node_id}  # the id its handshake proved
        return [own, *report["forward"]], None


def open_link(
    hops: list[Hop],
    digest: str,
    size: int,
    cluster_key: bytes | None,
    timeout: float,
    tick: Tick,
    kept: KeptLinks | None = None,
) -> tuple[list[dict[str, Any]], Link | None]:
    """Ask hops in turn to take the blob until one answers; (entries of the hops that did
    not, the link to the one that did, which serves every hop after it, or None). A link
    `kept` to the hop asked is used before a new one is opened."""
    skipped: list[dict[str, Any]] = []
    for index, (host, port) in enumerate(hops):
        peer = protocol.peer_text(host, port)
        rest = hops[index + 1 :]
        sock: socket.socket | None = None
        node_id: str | None = None
        request = {
            "op": "chain_put",
            "digest": digest,
            "size": size,
            "forward": [protocol.peer_text(h, p) for h, p in rest],
        }
        try:
            header: dict[str, Any] | None = None
            reused = kept.take((host, port)) if kept is not None else None
            if reused is not None:
                sock, node_id = reused
                try:
                    header = _ask(sock, request, peer, tick)
                except (PeerClosedError, ConnectionError):
                    # Closed as it was taken (the next node's timeout, a restart): nothing
                    # was answered, so the request goes again on a new connection.
                    _close(sock)
                    sock, node_id = None, None
            if header is None:
                # A next node that does not answer is given up sooner than our sender would
                # give up on us, though our keepalive frames keep it waiting anyway.
                sock = wire.connect(host, port, timeout * defaults.CHAIN_DOWNSTREAM_TIMEOUT_SHARE)
                # The next node checks us like any client: the same key, the same proofs.
                node_id = wire.client_handshake(sock, cluster_key, peer)
                header = _ask(sock, request, peer, tick)
            status = header.get("status")
            if status not in ("continue", "exists"):
                raise ProtocolError(f"node {peer} answered a chain_put with {header!r}")
            return skipped, Link(sock, peer, node_id, hops[index:], status == "continue")
        except (OSError, SmoltorrentError) as exc:
            if sock is not None:
                _close(sock)
            log.warning("chain: skipping %s for blob %s: %s", peer, digest[:12], exc)
            skipped.append(
                protocol.chain_entry(
                    protocol.CHAIN_FAILED, node_id, error_code(exc), f"node {peer}: {exc}"
                )
            )
    return skipped, None


def _ask(sock: socket.socket, request: dict[str, Any], peer: str, tick: Tick) -> dict[str, Any]:
    """Send a chain_put's header; the next node's first answer after its progress frames."""
    wire.send_frame_header(sock, request, request["size"])
    return wire.recv_final_response(sock, peer, tick)[0]


def push_copy(
    fd: int,
    size: int,
    digest: str,
    hops: list[Hop],
    cluster_key: bytes | None,
    timeout: float,
    tick: Tick,
) -> tuple[list[dict[str, Any]], int]:
    """Pass our verified copy (fd) down the chain `hops`; (one entry per hop, bytes sent)."""
    entries: list[dict[str, Any]] = []
    sent = 0
    while len(entries) < len(hops):
        todo = hops[len(entries) :]
        skipped, link = open_link(todo, digest, size, cluster_key, timeout, tick)
        entries += skipped
        if link is None:
            break
        link.send_file(fd, size)
        sent += link.sent
        reached, cut_from = link.finish(tick, timeout)
        if cut_from is None:
            entries += reached
        else:
            # Only the node that broke off is given up; the ones after it get our copy next.
            entries += reached[:cut_from]
    return entries, sent
