"""One client connection on a shard server: the handshake, then requests in sequence.

A request the node refuses gets a typed error frame and the connection stays
usable when the stream is still in step (no unread body); anything that
breaks framing gets an error frame if possible and the connection is closed.
Nothing a peer sends can make this allocate more than one fixed buffer.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from smoltorrent import defaults
from smoltorrent.errors import (
    AuthenticationError,
    DigestMismatchError,
    DiskFullError,
    DiskIOError,
    FrameTooLargeError,
    NodeError,
    NotFoundError,
    PeerClosedError,
    ProtocolError,
    SmoltorrentError,
    UnsupportedVersionError,
)
from worker_server import chain, protocol, wire
from worker_server.blob_store import BlobStore
from worker_server.limits import MemoryBudget
from worker_server.metrics import NodeMetrics
from worker_server.scrub import Scrubber
from worker_server.token_bucket import TokenBucket

log = logging.getLogger(__name__)

# Most specific first: the first class an error is an instance of gives its code.
ERROR_CODE_BY_CLASS: tuple[tuple[type[SmoltorrentError], str], ...] = (
    (UnsupportedVersionError, "unsupported_version"),
    (FrameTooLargeError, "too_large"),
    (AuthenticationError, "unauthorized"),
    (ProtocolError, "bad_request"),
    (NotFoundError, "not_found"),
    (DigestMismatchError, "digest_mismatch"),
    (DiskFullError, "disk_full"),
    (DiskIOError, "disk_error"),
)


class _ResponseCutShort(Exception):
    """A response body could not be finished after its header went out; only closing is left."""


def error_code_for(exc: SmoltorrentError) -> str:
    if isinstance(exc, NodeError):
        return exc.code
    for error_class, code in ERROR_CODE_BY_CLASS:
        if isinstance(exc, error_class):
            return code
    return "internal"


class Session:
    """Serves one accepted connection until the client leaves or breaks the protocol."""

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        store: BlobStore,
        cluster_key: bytes | None,
        socket_timeout: float,
        *,
        body_budget: MemoryBudget,
        metrics: NodeMetrics | None = None,
        scrubber: Scrubber | None = None,
        repair_bucket: TokenBucket | None = None,
    ) -> None:
        self.body_budget = body_budget
        # Every repair push this node makes pays into it, whichever session asked for it.
        self.repair_bucket = repair_bucket or TokenBucket(defaults.REPAIR_BPS)
        self.scrubber = scrubber
        self.sock = wire.session_socket(sock)
        self.metrics = metrics or NodeMetrics(store.node_id)
        self.peer = peer
        self.store = store
        self.cluster_key = cluster_key
        self.socket_timeout = socket_timeout
        self._unread_body = 0  # bytes of the current request's body not read yet
        self.links = chain.KeptLinks()  # to the next node of this connection's chain_puts
        interval = min(defaults.PROGRESS_INTERVAL_S, socket_timeout / 4)
        self.keepalive = chain.Keepalive(self.sock, interval)  # for every chain_put here

    def run(self) -> None:
        try:
            self._handshake()
            while self._serve_one_request():
                pass
        except AuthenticationError as exc:
            log.warning("rejected %s: %s", self.peer, exc)
            if self.sock.frame_auth is None:  # the handshake has sent its own error frame
                wire.close_after_error(self.sock)
            else:
                self._send_error_then_close("unauthorized", str(exc))
        except (PeerClosedError, TimeoutError) as exc:
            log.info("dropping %s: %s", self.peer, exc or "timed out")
        except _ResponseCutShort as exc:
            log.error("closing %s mid-answer: %s", self.peer, exc)
        except ProtocolError as exc:
            log.warning("closing %s after a malformed frame: %s", self.peer, exc)
            self._send_error_then_close(error_code_for(exc), str(exc))
        except OSError as exc:
            log.warning("connection with %s failed: %s", self.peer, exc)
        except Exception:
            log.exception("internal error while serving %s", self.peer)
            self._send_error_then_close("internal", "the node hit an internal error; see its log")
        finally:
            self.keepalive.close()
            self.links.close()
            self.sock.close()

    def _handshake(self) -> None:
        try:
            with wire.deadline(self.sock, defaults.HANDSHAKE_DEADLINE_S):
                wire.server_handshake(self.sock, self.store.node_id, self.cluster_key)
        except TimeoutError:
            log.warning(
                "dropping %s: no handshake within the %.0f s deadline",
                self.peer,
                defaults.HANDSHAKE_DEADLINE_S,
            )
            raise

    def _send_error_then_close(self, code: str, message: str) -> None:
        with contextlib.suppress(OSError):  # the peer may be gone; then nobody is left to tell
            wire.send_frame(self.sock, protocol.error_header(code, message))
        wire.close_after_error(self.sock)

    def _serve_one_request(self) -> bool:
        """Serve the next request; False when the connection should end."""
        frame = wire.recv_frame_header(self.sock)
        if frame is None:
            return False
        header, body_len = frame
        # A put's body only follows our "continue", so nothing is pending until we say so.
        self._unread_body = 0 if header.get("op") in ("put", "chain_put") else body_len
        started = time.monotonic()
        try:
            request = protocol.validate_request(header, body_len)
            handler = HANDLERS[request["op"]]
            with self._body_reserved(request["op"], body_len):
                handler(self, request)
            self.metrics.observe_request(request["op"], time.monotonic() - started)
        except (PeerClosedError, AuthenticationError):
            raise  # the stream cannot be trusted any more: the connection ends
        except SmoltorrentError as exc:
            if isinstance(exc, DigestMismatchError):
                self.metrics.verify_failed("put")
            code = error_code_for(exc)
            log.info("%s %s refused (%s): %s", self.peer, header.get("op"), code, exc)
            if self._unread_body:
                self._send_error_then_close(code, str(exc))
                return False
            wire.send_frame(self.sock, protocol.error_header(code, str(exc)))
        return True

    @contextlib.contextmanager
    def _body_reserved(self, op: str, body_len: int) -> Iterator[None]:
        """Hold a JSON body's bytes against the node's budget while the request runs."""
        if protocol.OPERATIONS[op][0] != protocol.BODY_JSON or body_len == 0:
            yield
            return
        if not self.body_budget.reserve(body_len):
            log.warning(
                "refusing %s's %s of %d bytes: JSON bodies in flight would pass the %d byte budget",
                self.peer,
                op,
                body_len,
                self.body_budget.total_bytes,
            )
            raise NodeError(
                "busy", "this node is reading too many large requests at once: retry shortly"
            )
        # Budget is held only as long as an honest sender needs: a peer trickling its body
        # would otherwise keep it taken for as long as each read beats the socket timeout.
        seconds = defaults.JSON_BODY_DEADLINE_BASE_S + body_len / defaults.MIN_TRANSFER_RATE_BPS
        try:
            with wire.deadline(self.sock, seconds):
                yield
        except TimeoutError:
            log.warning(
                "dropping %s: its %d byte %s body did not arrive within %.0f s",
                self.peer,
                body_len,
                op,
                seconds,
            )
            raise
        finally:
            self.body_budget.release(body_len)

    def _read_body(self) -> bytes:
        body = wire.recv_body(self.sock, self._unread_body)
        self._unread_body = 0
        return body

    def _reply_json(self, value: Any, **header: Any) -> None:
        body = protocol.encode_json(value)
        if len(body) > defaults.MAX_JSON_BODY_BYTES:
            raise FrameTooLargeError(
                f"the answer is {len(body)} bytes, over the {defaults.MAX_JSON_BODY_BYTES}"
                " byte JSON body limit: ask about fewer items at a time"
            )
        wire.send_frame(self.sock, {"ok": True, **header}, body)

    def op_ping(self, request: dict[str, Any]) -> None:
        wire.send_frame(self.sock, {"ok": True, "node_id": self.store.node_id})

    def op_stat(self, request: dict[str, Any]) -> None:
        stat = self.store.stat()
        wire.send_frame(self.sock, {"ok": True, **stat, "protocol": defaults.PROTOCOL_VERSION})

    def op_has(self, request: dict[str, Any]) -> None:
        body = wire.recv_json_body(self.sock, self._unread_body, what="list of digests")
        self._unread_body = 0
        digests = protocol.validate_digest_list(body)
        self._reply_json(self.store.present(digests))

    def op_list(self, request: dict[str, Any]) -> None:
        page, more = self.store.inventory_page(request["after"], request["limit"])
        self._reply_json(page, more=more)

    def _ticker(self) -> Callable[[int], None]:
        """Progress frames often enough that a peer waiting one socket timeout never gives up
        on a node that is still working."""
        interval = min(defaults.PROGRESS_INTERVAL_S, self.socket_timeout / 4)
        return wire.progress_ticker(self.sock, interval)

    def op_put(self, request: dict[str, Any]) -> None:
        digest, size = request["digest"], request["size"]
        if self._held_whole(digest, size, self._ticker()):
            wire.send_frame(self.sock, {"ok": True, "status": "exists"})
            return
        with self.store.begin_put(digest, size) as incoming:
            wire.send_frame(self.sock, {"ok": True, "status": "continue"})
            self._unread_body = size
            # The sender may have pushed its last byte long before it reaches us (buffers on
            # a slow link): progress frames tell it, and whoever waits on it, we still receive.
            tick, received = self._ticker(), 0

            def sink(chunk: memoryview) -> None:
                nonlocal received
                incoming.write(chunk)
                received += len(chunk)
                tick(received)

            wire.recv_stream(self.sock, size, sink, digest_covered=True)
            self._unread_body = 0
            incoming.commit()
        self.metrics.received(size)
        log.info("stored blob %s (%d bytes) from %s", digest, size, self.peer)
        wire.send_frame(self.sock, {"ok": True, "status": "stored"})

    def _held_whole(self, digest: str, size: int, tick: Callable[[int], None]) -> bool:
        """Before a put: True if our copy of `digest` is whole at `size` (answer "exists").
        A damaged copy is set aside first, so a failed put leaves none in reads; the fresh
        copy published deletes the quarantined one. A copy that hashes to its name at
        another size is good, and the put is what is wrong (no `size` bytes can hash to
        that name): ProtocolError, and the good copy stays."""
        if not self.store.has(digest):
            return False
        held = self.store.verified_size(digest, tick)
        if held == size:
            return True
        if held is not None:
            raise ProtocolError(
                f"blob {digest} is {held} bytes here, verified; a put of {size} bytes "
                "cannot be that blob"
            )
        log.warning("blob %s here is damaged; quarantining it to receive it again", digest)
        with contextlib.suppress(FileNotFoundError):
            self.store.quarantine(digest, inode=self.store.blob_path(digest).stat().st_ino)
        return False

    def op_chain_put(self, request: dict[str, Any]) -> None:
        """A put that passes the blob on down `forward` while it arrives (see chain.py).

        Answers "exists" (no body wanted: our verified copy is pushed down the chain) or
        "continue", then, after progress frames, {"status": "done", "self": our fate,
        "forward": one entry per forward node}. Our own failure is in the report, not an
        error frame, so the sender still learns what became of every other copy."""
        with self.keepalive.running() as keepalive:
            own, forward = self._chain_put(request, keepalive)
        self._send_chain_report(request["digest"], request["size"], own, forward)

    def _chain_put(
        self, request: dict[str, Any], keepalive: chain.Keepalive
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(our own fate, one per forward node); every frame to our sender until the report
        goes through `keepalive`, which sends progress frames meanwhile."""
        digest, size, hops = request["digest"], request["size"], request["forward"]

        def tick(done: int) -> None:
            pass  # the keepalive thread reports progress; nothing else may write to our sender

        if self._held_whole(digest, size, tick):
            keepalive.send({"ok": True, "status": "exists"})
            own = protocol.chain_entry(protocol.CHAIN_EXISTS, self.store.node_id)
            return own, self._push_own_copy(digest, hops, tick)
        with self.store.begin_put(digest, size) as incoming:
            # The next node is asked before our sender is told to go, so the body passes
            # through in one go; its "continue" or refusal is known before the first byte.
            forward, link = chain.open_link(
                hops, digest, size, self.cluster_key, self.socket_timeout, tick, self.links
            )
            try:
                keepalive.send({"ok": True, "status": "continue"})
                self._unread_body = size
                received = 0

                def sink(chunk: memoryview) -> None:
                    nonlocal received
                    incoming.write(chunk)  # a write error is kept for commit; we go on
                    if link is not None:
                        link.send(chunk)
                    received += len(chunk)
                    keepalive.progress = received

                wire.recv_stream(self.sock, size, sink, digest_covered=True)
                self._unread_body = 0
                own = self._commit_chain_copy(incoming, digest, size)
                if link is not None:
                    reached, cut_from = link.finish(tick, self.socket_timeout, self.links)
                    self.metrics.sent(link.sent)
                    cut = [] if cut_from is None else link.hops[cut_from:]
                    forward += reached[: len(reached) - len(cut)]
                    if cut and own["status"] == protocol.CHAIN_STORED:
                        forward += self._push_own_copy(digest, cut, tick)
                    else:
                        forward += reached[len(reached) - len(cut) :]
            finally:
                if link is not None:
                    link.close()
        return own, forward

    def _commit_chain_copy(self, incoming: Any, digest: str, size: int) -> dict[str, Any]:
        node_id = self.store.node_id
        try:
            incoming.commit()
        except (DigestMismatchError, DiskFullError, DiskIOError, OSError) as exc:
            if isinstance(exc, DigestMismatchError):
                self.metrics.verify_failed("put")
            log.warning("chain copy of blob %s from %s failed: %s", digest, self.peer, exc)
            return protocol.chain_entry(
                protocol.CHAIN_FAILED, node_id, chain.error_code(exc), str(exc)
            )
        self.metrics.received(size)
        # Logged with the chain's fates in _send_chain_report: one line per blob, not two.
        return protocol.chain_entry(protocol.CHAIN_STORED, node_id)

    def _push_own_copy(
        self, digest: str, hops: list[tuple[str, int]], tick: Callable[[int], None]
    ) -> list[dict[str, Any]]:
        if not hops:
            return []
        try:
            fd, size = self.store.open_blob(digest)
        except NotFoundError as exc:  # deleted under us meanwhile
            return chain.unreached(hops, str(exc))
        try:
            entries, sent = chain.push_copy(
                fd, size, digest, hops, self.cluster_key, self.socket_timeout, tick
            )
        finally:
            os.close(fd)
        self.metrics.sent(sent)
        return entries

    def _send_chain_report(
        self, digest: str, size: int, own: dict[str, Any], forward: list[dict[str, Any]]
    ) -> None:
        fates = [own["status"], *(entry["status"] for entry in forward)]
        log.info(
            "chain of blob %s (%d bytes from %s): %s", digest, size, self.peer, " -> ".join(fates)
        )
        wire.send_frame(self.sock, {"ok": True, "status": "done", "self": own, "forward": forward})

    def op_get(self, request: dict[str, Any]) -> None:
        fd, size = self.store.open_blob(request["digest"])
        try:
            offset = request["offset"]
            length = size - offset if request["length"] is None else request["length"]
            if offset > size or offset + length > size:
                raise ProtocolError(
                    f"range {offset}+{length} is outside blob {request['digest'][:12]},"
                    f" which is {size} bytes"
                )
            # A whole blob is checked against its digest by the client; a range is tagged.
            whole = offset == 0 and request["length"] is None
            try:
                wire.send_file_frame(
                    self.sock,
                    {"ok": True, "length": length},
                    fd,
                    offset,
                    length,
                    digest_covered=whole,
                )
            except ProtocolError as exc:  # the blob file shrank under us: tampered with on disk
                raise _ResponseCutShort(f"blob {request['digest']}: {exc}") from exc
            self.metrics.sent(length)
        finally:
            os.close(fd)

    def op_verify(self, request: dict[str, Any]) -> None:
        bad = self.store.verify(request["digests"])
        if bad:
            self.metrics.verify_failed("at_rest", len(bad))
        self._reply_json(bad)

    def op_scrub(self, request: dict[str, Any]) -> None:
        if self.scrubber is None:
            raise NodeError("internal", "this node runs without a scrubber")
        start = request["start"]
        self._reply_json(self.scrubber.request_pass() if start else self.scrubber.status())

    def op_discard(self, request: dict[str, Any]) -> None:
        discarded = self.store.discard_quarantined(request["digest"])
        if discarded:
            log.info("discarded quarantined copy %s for %s", request["digest"], self.peer)
        wire.send_frame(self.sock, {"ok": True, "deleted": discarded})

    def op_delete(self, request: dict[str, Any]) -> None:
        deleted = self.store.delete(request["digest"])
        if deleted:
            log.info("deleted blob %s at the request of %s", request["digest"], self.peer)
        wire.send_frame(self.sock, {"ok": True, "deleted": deleted})

    def op_replicate(self, request: dict[str, Any]) -> None:
        digest = request["digest"]
        host, port = request["peer"]
        peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        fd, size = self.store.open_blob(digest)
        try:
            stored = self._push_blob(
                peer, host, port, digest, fd, size, self._ticker(), self._repair_pace(request)
            )
        finally:
            os.close(fd)
        if stored:
            self.metrics.sent(size)
        log.info("replicated blob %s to %s (%s)", digest, peer, "stored" if stored else "exists")
        wire.send_frame(self.sock, {"ok": True, "status": "stored" if stored else "exists"})

    def op_replicate_batch(self, request: dict[str, Any]) -> None:
        """Push our copies of `digests` to one peer over one connection, one after the other
        at the repair rate; the answer says, per digest, stored, exists, missing (we hold
        no whole copy), mismatch (the peer hashed other bytes) or failed: <why>. One blob's
        fate never spoils the others: a connection the peer broke is opened again for the
        next one, and only a peer that cannot be reached at all fails the rest."""
        host, port = request["peer"]
        peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        pace, tick = self._repair_pace(request), self._ticker()
        outcomes: dict[str, str] = {}
        link: socket.socket | None = None
        unreachable = ""
        try:
            for digest in request["digests"]:
                if unreachable:
                    outcomes[digest] = f"failed: {unreachable}"
                    continue
                try:
                    fd, size = self.store.open_blob(digest)
                except NotFoundError:
                    outcomes[digest] = "missing"
                    continue
                try:
                    if link is None:
                        link = self._peer_link(peer, host, port)
                    stored = wire.send_put(link, peer, digest, b"", fd, 0, size, tick, pace=pace)
                    outcomes[digest] = "stored" if stored else "exists"
                    if stored:
                        self.metrics.sent(size)
                except DigestMismatchError:
                    outcomes[digest] = "mismatch"
                except NodeError as exc:
                    if exc.code == "peer_unavailable":  # our connect or handshake failed
                        unreachable = str(exc)
                    outcomes[digest] = f"failed: {exc}"
                except (OSError, ProtocolError) as exc:
                    # The stream is broken or out of step: the next blob gets a new one.
                    outcomes[digest] = f"failed: the push to {peer} broke off ({exc})"
                    if link is not None:
                        link.close()
                    link = None
                finally:
                    os.close(fd)
        finally:
            if link is not None:
                link.close()
        copied = sum(1 for how in outcomes.values() if how == "stored")
        log.info("replicated %d of %d blobs to %s", copied, len(outcomes), peer)
        self._reply_json({d: how[: defaults.REPAIR_OUTCOME_CHARS] for d, how in outcomes.items()})

    def _peer_link(self, peer: str, host: str, port: int) -> socket.socket:
        """An authenticated connection to the peer; NodeError peer_unavailable if none."""
        try:
            sock = wire.connect(host, port, self.socket_timeout)
        except OSError as exc:
            raise _peer_unavailable(peer, exc) from exc
        try:
            wire.client_handshake(sock, self.cluster_key, peer)
        except (AuthenticationError, OSError, PeerClosedError) as exc:
            sock.close()
            raise _peer_unavailable(peer, exc) from exc
        return sock

    def _push_blob(
        self,
        peer: str,
        host: str,
        port: int,
        digest: str,
        fd: int,
        size: int,
        progress: Callable[[int], None],
        pace: Callable[[int], None] | None,
    ) -> bool:
        """Put our copy on the peer; progress frames to our client keep a long copy alive."""
        try:
            with wire.connect(host, port, self.socket_timeout) as peer_sock:
                wire.client_handshake(peer_sock, self.cluster_key, peer)
                return wire.send_put(peer_sock, peer, digest, b"", fd, 0, size, progress, pace=pace)
        except AuthenticationError as exc:
            raise NodeError("peer_unavailable", f"peer {peer} refused this node: {exc}") from exc
        except (OSError, PeerClosedError) as exc:
            raise NodeError(
                "peer_unavailable",
                f"cannot push blob {digest[:12]} to peer {peer} ({exc}): check that the peer"
                " is running and reachable from this node",
            ) from exc

    def _repair_pace(self, request: dict[str, Any]) -> Callable[[int], None] | None:
        """What a repair push pays each slice to: the node's repair bucket at the rate the
        request names (the coordinator's SMOLTORRENT_REPAIR_BPS), so this node's repair
        pushes together keep to it and its port stays free for gathers; None unpaced."""
        if not request["rate"]:
            return None
        self.repair_bucket.set_rate(request["rate"])
        return self.repair_bucket.take

    def op_manifest_put(self, request: dict[str, Any]) -> None:
        data = self._read_body()
        key, offset, total = request["key"], request["offset"], request["total"]
        if total is None or (offset == 0 and total == len(data)):
            protocol.decode_json(data, what=f"manifest {key!r}")
            self.store.put_manifest(key, data)
        else:  # a part: too large to check as JSON here; its reader parses and checks it
            self.store.put_manifest_part(key, offset, total, data)
        wire.send_frame(self.sock, {"ok": True})

    def op_manifest_list(self, request: dict[str, Any]) -> None:
        keys = self.store.list_manifests()
        start = 0 if request["after"] is None else bisect.bisect_right(keys, request["after"])
        page = keys[start : start + request["limit"]]
        self._reply_json(page, more=start + len(page) < len(keys))

    def op_manifest_get(self, request: dict[str, Any]) -> None:
        length = request["length"]
        if length is not None and length > defaults.MAX_JSON_BODY_BYTES:
            raise FrameTooLargeError(
                f"a manifest_get reads at most {defaults.MAX_JSON_BODY_BYTES} bytes, not {length}"
            )
        size, data = self.store.get_manifest_range(
            request["key"], request["offset"], length or defaults.MAX_JSON_BODY_BYTES
        )
        if length is None and len(data) < size:
            raise FrameTooLargeError(
                f"manifest {request['key']!r} is {size} bytes, over one answer's"
                f" {defaults.MAX_JSON_BODY_BYTES}: read it in parts (offset, length)"
            )
        wire.send_frame(self.sock, {"ok": True, "size": size}, data)

    def op_manifest_delete(self, request: dict[str, Any]) -> None:
        wire.send_frame(
            self.sock, {"ok": True, "deleted": self.store.delete_manifest(request["key"])}
        )

    def op_auth(self, request: dict[str, Any]) -> None:
        if self.cluster_key:
            raise ProtocolError("this connection is authenticated already")
        raise ProtocolError("this node has no cluster key, so there is nothing to authenticate")


def _peer_unavailable(peer: str, exc: Exception) -> NodeError:
    return NodeError(
        "peer_unavailable",
        f"cannot reach peer {peer} ({exc}): check that it is running and reachable from this node",
    )


HANDLERS: dict[str, Callable[[Session, dict[str, Any]], None]] = {
    op: getattr(Session, f"op_{op}") for op in protocol.OPERATIONS
}
