"""Client side of the wire protocol: one NodeClient talks to one shard server.

Every method opens its own connection (auth handshake included), so a client
object is cheap and thread-safe; a run of many blob reads (a gather's chunks)
shares KeptConnections instead, and each read after the first to a node skips
the connect and the handshake. Network failures raise NodeUnavailableError;
error frames raise NodeError (code attribute), DigestMismatchError for
`digest_mismatch`, and AuthenticationError for `unauthorized`.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from smoltorrent import defaults
from smoltorrent.cluster_key import key_from_env
from smoltorrent.errors import (
    DigestMismatchError,
    NodeError,
    NodeUnavailableError,
    PeerClosedError,
    ProtocolError,
    SmoltorrentError,
)
from worker_server import protocol, wire

if TYPE_CHECKING:
    from coordinator.dataplane.bandwidth import WireMeter

ADDRESS_PATTERN = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^:\[\]\s]+)):(?P<port>\d+)")


T = TypeVar("T")


@dataclass(frozen=True)
class NodeAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, default_port: int | None = None) -> NodeAddress:
        """'host:port' or '[v6]:port' -> NodeAddress; SmoltorrentError with a hint if malformed.
        With default_port, a bare 'host' or '[v6]' takes that port."""
        match = ADDRESS_PATTERN.fullmatch(text.strip())
        if not match and default_port is not None:
            match = ADDRESS_PATTERN.fullmatch(f"{text.strip()}:{default_port}")
        port = int(match["port"]) if match else 0
        if not match or not 0 < port < 65536:
            raise SmoltorrentError(
                f"{text!r} is not a node address: write it as host:port (e.g. pi4.local:"
                f"{defaults.DEFAULT_PORT}) or [ipv6]:port"
            )
        return cls(match["v6"] or match["host"], port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def is_loopback(self) -> bool:
        """On the machine that connects to it (127.0.0.0/8, ::1, localhost)."""
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


@dataclass(frozen=True)
class NodeStat:
    node_id: str
    free_bytes: int
    total_bytes: int
    used_bytes: int  # bytes held in blobs
    blob_count: int
    protocol_version: int
    quarantined: int = 0  # bad copies its scrub holds (0 from a node that does not say)
    data_dir: str = ""  # its data directory, on its own host ("" from a node that does not say)


@dataclass(frozen=True)
class ChainReport:
    """What a chain_put did: bytes this link carried, the head's fate, each forward node's.

    A fate is {"status": "stored" | "exists" | "failed", "node_id": the id the node proved
    (None if never reached), "error": a wire error code, "message": why} (the last two only
    when failed)."""

    sent: int
    head: dict[str, Any]
    forward: list[tuple[NodeAddress, dict[str, Any]]]


class KeptConnections:
    """Authenticated connections kept open between the blob reads of one run (a gather's
    chunks, each a few MB) or the chain puts of one chain task (its batch of chunks): a
    call otherwise pays a TCP connect, a thread on the node and the key handshake,
    hundreds of times per gigabyte. A connection is kept only after a call that ended in
    step; at most one per thread reading from a node is open at once.
    close() (or the end of a with block) closes the idle ones. Thread-safe."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, bytes | None], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(self, key: tuple[str, bytes | None]) -> socket.socket | None:
        """An idle connection to that node with that key, None if none is left open."""
        while True:
            with self._lock:
                idle = self._idle.get(key)
                if not idle:
                    return None
                sock = idle.pop()
            if wire.quiet(sock):
                return sock
            sock.close()  # the node closed it while it sat idle (its timeout, a restart)

    def give(self, key: tuple[str, bytes | None], sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(key, []).append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [sock for socks in self._idle.values() for sock in socks]
            self._idle.clear()
        for sock in idle:
            sock.close()

    def __enter__(self) -> KeptConnections:
        return self

    def __exit__(self, *_) -> None:
        self.close()


class NodeClient:
    def __init__(
        self,
        address: NodeAddress,
        *,
        cluster_key: bytes | None = None,
        timeout: float | None = None,
        meter: WireMeter | None = None,
        kept: KeptConnections | None = None,
    ) -> None:
        self.address = address
        self.cluster_key = cluster_key or key_from_env()
        self.timeout = defaults.SOCKET_TIMEOUT_S if timeout is None else timeout
        # Told of every slice of blob bytes sent or received (a transfer's meter,
        # coordinator/dataplane/bandwidth.py): counts them, and may wait for a limit. The
        # meter also says how large a slice may be, so no caller can pair the two wrongly.
        self.meter = meter
        # Where whole-blob reads and chain puts take and leave their connections; None:
        # one per call.
        self.kept = kept

    @property
    def pace(self) -> Callable[[int], None] | None:
        return None if self.meter is None else self.meter.wire

    @property
    def slice_bytes(self) -> int | None:
        """The most bytes a blob read or send moves before pace is told (None: as large as
        an unmetered one); irrelevant without a meter."""
        return None if self.meter is None else self.meter.slice_bytes

    def paced(self, meter: WireMeter | None) -> NodeClient:
        """The same node, its blob bytes counted (and limited) by `meter`, a transfer's."""
        return NodeClient(
            self.address,
            cluster_key=self.cluster_key,
            timeout=self.timeout,
            meter=meter,
            kept=self.kept,
        )

    def keeping(self, kept: KeptConnections) -> NodeClient:
        """The same node, its blob reads over the connections `kept` holds."""
        return NodeClient(
            self.address,
            cluster_key=self.cluster_key,
            timeout=self.timeout,
            meter=self.meter,
            kept=kept,
        )

    @contextmanager
    def _connection(self, timeout: float | None = None) -> Iterator[socket.socket]:
        """An authenticated connection; network failures become NodeUnavailableError."""
        with self._unavailable(), self._connect(timeout) as sock:
            yield sock

    def _connect(self, timeout: float | None = None) -> socket.socket:
        """A new authenticated connection (network errors raised as they come)."""
        sock = wire.connect(self.address.host, self.address.port, timeout or self.timeout)
        try:
            wire.client_handshake(sock, self.cluster_key, str(self.address))
        except BaseException:
            sock.close()
            raise
        return sock

    @contextmanager
    def _answered(self, request: dict[str, Any]) -> Iterator[tuple[socket.socket, int]]:
        """Send `request` and read its answer's header: (the connection, its body length),
        the body left to the caller (see _exchange)."""

        def ask(sock: socket.socket) -> int:
            wire.send_frame(sock, request)
            return wire.recv_response(sock, str(self.address))[1]

        with self._exchange(ask) as answered:
            yield answered

    @contextmanager
    def _exchange(self, ask: Callable[[socket.socket], T]) -> Iterator[tuple[socket.socket, T]]:
        """(the connection, what ask(connection) returned: it sends a request and reads the
        first answer). With `kept`, on a kept connection if one is idle, and the connection
        is kept again once the block ends without an error. A kept one the node closed as
        it was taken fails before any answer: the request goes again on a new connection,
        never after an answer began."""
        key = (str(self.address), self.cluster_key)
        with self._unavailable():
            sock = self.kept.take(key) if self.kept else None
            if sock is not None:
                sock.settimeout(self.timeout)
                try:
                    answer = ask(sock)
                except (PeerClosedError, ConnectionError):
                    sock.close()
                    sock = None
                except BaseException:
                    sock.close()
                    raise
            if sock is None:
                sock = self._connect()
                try:
                    answer = ask(sock)
                except BaseException:
                    sock.close()
                    raise
            try:
                yield sock, answer
            except BaseException:
                sock.close()
                raise
        if self.kept:
            self.kept.give(key, sock)
        else:
            sock.close()

    @contextmanager
    def _unavailable(self) -> Iterator[None]:
        """Network failures inside become NodeUnavailableError."""
        peer = str(self.address)
        try:
            yield
        except (TimeoutError, PeerClosedError) as exc:
            raise NodeUnavailableError(
                f"node {peer} stopped answering ({exc}): check that it is running and not"
                " overloaded, or raise the timeout"
            ) from exc
        except OSError as exc:
            raise NodeUnavailableError(
                f"cannot reach node {peer} ({exc.strerror or exc}): check that its shard server"
                " is running and that this address and port are right"
            ) from exc

    def _call(self, header: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """One request and its whole response (the body bounded by MAX_JSON_BODY_BYTES)."""
        with self._connection() as sock:
            wire.send_frame(sock, header, body)
            response, body_len = wire.recv_response(sock, str(self.address))
            return response, wire.recv_body(sock, _bounded_body(body_len, self.address))

    def _call_json(self, header: dict[str, Any], body: bytes = b"") -> Any:
        with self._connection() as sock:
            wire.send_frame(sock, header, body)
            return self._recv_json_answer(sock)

    def _recv_json_answer(self, sock: socket.socket) -> Any:
        _, body_len = wire.recv_response(sock, str(self.address))
        return wire.recv_json_body(sock, body_len, what=f"answer from node {self.address}")

    def ping(self) -> str:
        """Round trip; returns the node id."""
        response, _ = self._call({"op": "ping"})
        return response["node_id"]

    def stat(self) -> NodeStat:
        response, _ = self._call({"op": "stat"})
        try:
            return NodeStat(
                node_id=response["node_id"],
                free_bytes=response["free_bytes"],
                total_bytes=response["total_bytes"],
                used_bytes=response["used_bytes"],
                blob_count=response["blob_count"],
                protocol_version=response["protocol"],
                quarantined=int(response.get("quarantined", 0)),
                data_dir=str(response.get("data_dir", "")),
            )
        except KeyError as exc:
            raise ProtocolError(f"node {self.address} sent a stat without {exc}") from None

    def has(self, digests: list[str]) -> set[str]:
        """The subset of digests the node holds as complete blobs."""
        present: set[str] = set()
        with self._connection() as sock:
            for batch in _batches(digests, defaults.HAS_BATCH_DIGESTS):
                wire.send_frame(sock, {"op": "has"}, protocol.encode_json(batch))
                present.update(protocol.validate_digest_list(self._recv_json_answer(sock)))
        return present & set(digests)

    def list_blobs(self, page_entries: int = defaults.LIST_PAGE_ENTRIES) -> dict[str, int]:
        """Inventory: digest -> size in bytes, read in pages of page_entries (one answer
        is bounded by MAX_JSON_BODY_BYTES; a node may hold far more blobs than fit one)."""
        inventory: dict[str, int] = {}
        for page in self._pages("list", page_entries):
            if not isinstance(page, dict):
                raise ProtocolError(f"node {self.address} sent an inventory that is not an object")
            inventory.update(
                (protocol.validate_digest(digest), protocol.validate_length(size, "size"))
                for digest, size in page.items()
            )
        return inventory

    def _pages(self, op: str, page_entries: int) -> Iterator[Any]:
        """Every page of a listing op, over one connection: each asks for the entries after
        the last one the previous page held, until the node says no more follow."""
        after = None
        with self._connection() as sock:
            while True:
                header = {"op": op, "limit": page_entries}
                if after is not None:
                    header["after"] = after
                wire.send_frame(sock, header)
                response, body_len = wire.recv_response(sock, str(self.address))
                page = wire.recv_json_body(sock, body_len, what=f"answer from node {self.address}")
                yield page
                if response.get("more") is not True or not page:
                    return
                last = max(page)
                if after is not None and last <= after:
                    raise ProtocolError(f"node {self.address} sent a page that does not advance")
                after = last

    def put_blob(
        self,
        digest: str,
        prefix: bytes,
        src_fd: int,
        src_offset: int,
        length: int,
        progress: Callable[[int], None] | None = None,
    ) -> bool:
        """Store a blob made of `prefix` then `length` bytes of src_fd at src_offset (sendfile).

        Returns True if stored, False if the node already had it (no body sent).
        DigestMismatchError if the node hashed something else; NodeError('disk_full') etc.
        progress(n): n bytes of the range sent so far (or re-hashed by the node, for a copy
        it has), called as they go.
        """
        with self._connection() as sock:
            return wire.send_put(
                sock,
                str(self.address),
                digest,
                prefix,
                src_fd,
                src_offset,
                length,
                progress,
                self.pace,
                self.slice_bytes,
            )

    def chain_put(
        self,
        digest: str,
        prefix: bytes,
        src_fd: int | None,
        src_offset: int,
        length: int,
        forward: list[NodeAddress],
        progress: Callable[[int], None] | None = None,
    ) -> ChainReport:
        """Store a blob on this node and have it passed on, node to node while it arrives,
        to each of `forward` in turn (chain replication): this link carries the bytes once.

        When the node already holds a verified copy, no byte is sent: it pushes its own copy
        down the chain. Returns what became of every copy; errors before the node took the
        request (unreachable, busy, disk full) are raised as from put_blob. With no
        `src_fd` the caller has no bytes to give (only the blob's size): a node that asks
        for them is a NodeError (code "missing") and gets none.
        """
        size = len(prefix) + length
        peer = str(self.address)
        request = {
            "op": "chain_put",
            "digest": digest,
            "size": size,
            "forward": [str(a) for a in forward],
        }

        def ask(sock: socket.socket) -> dict[str, Any]:
            # The node checks the blob against its digest, so the body goes untagged
            # (sendfile).
            wire.send_frame_header(sock, request, size)
            return wire.recv_final_response(sock, peer, progress)[0]

        # With `kept`, a chain task's entries share one connection to their chain's head.
        with self._exchange(ask) as (sock, header):
            status = header.get("status")
            if status == "continue" and src_fd is None:
                # The connection closes unsent: the node drops the put it was waiting on.
                raise NodeError("missing", f"node {peer} does not hold blob {digest}")
            if status == "continue":
                wire.send_prefix(sock, prefix, self.pace)
                wire.send_file_range(
                    sock, src_fd, src_offset, length, progress, self.pace, self.slice_bytes
                )
            elif status != "exists":
                raise ProtocolError(f"node {peer} answered a chain_put with {header!r}")
            header, _ = wire.recv_final_response(sock, peer, progress)
            report = protocol.validate_chain_report(header, len(forward))
        return ChainReport(
            sent=size if status == "continue" else 0,
            head=report["self"],
            forward=list(zip(forward, report["forward"], strict=True)),
        )

    def get_blob_to_file(
        self,
        digest: str,
        out_fd: int,
        out_offset: int,
        *,
        size: int | None = None,
        skip: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> str:
        """Stream the whole blob: the first `skip` bytes are hashed only, the rest hashed and
        pwritten at out_offset. Returns the SHA-256 hex of everything received, which is
        `digest`: DigestMismatchError otherwise. progress(nbytes) is called as data arrives.

        With `size` (the blob size the manifest promises), a copy of any other length is
        refused before one byte of it is written, and no write goes past out_offset +
        size - skip: an oversized copy cannot spill into the neighbouring shard's range.
        """
        request = {"op": "get", "digest": digest, "offset": 0, "length": None}
        with self._answered(request) as (sock, body_len):
            if size is not None and body_len != size:
                raise DigestMismatchError(
                    f"blob {digest[:12]} on node {self.address} is {body_len} bytes, not the"
                    f" {size} its manifest promises: that copy is corrupt; fetch it from"
                    " another replica"
                )
            received = wire.recv_to_file(
                sock,
                body_len,
                out_fd,
                out_offset,
                skip=skip,
                limit=None if size is None else size - skip,
                progress=progress,
                pace=self.pace,
                slice_bytes=self.slice_bytes,
            )
        if received != digest:
            raise DigestMismatchError(
                f"blob {digest[:12]} from node {self.address} hashed to {received[:12]}:"
                " that copy is corrupt; fetch it from another replica"
            )
        return received

    def read_blob(
        self,
        digest: str,
        sink: Callable[[memoryview], None],
        *,
        offset: int = 0,
        length: int | None = None,
        size: int | None = None,
    ) -> int:
        """Stream `length` bytes of a blob from `offset` (the whole blob when length is None)
        into sink(chunk), chunk by chunk through one buffer; returns the bytes received.

        The caller verifies them: a whole blob against its digest, a range against the
        digests of the tensors it holds. A node answering with another length than asked
        (or, for a whole blob, than the manifest's `size`) is refused before any byte
        reaches the sink.
        """
        request = {"op": "get", "digest": digest, "offset": offset, "length": length}
        with self._answered(request) as (sock, body_len):
            expected = size if length is None else length
            if expected is not None and body_len != expected:
                raise DigestMismatchError(
                    f"blob {digest[:12]} on node {self.address} answered {body_len} bytes, not"
                    f" the {expected} asked for: that copy is corrupt; read another replica"
                )
            wire.recv_stream(
                sock,
                body_len,
                sink,
                digest_covered=True,
                pace=self.pace,
                slice_bytes=self.slice_bytes,
            )
        return body_len

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        """Small reads (bounded by MAX_JSON_BODY_BYTES)."""
        if length > defaults.MAX_JSON_BODY_BYTES:
            raise ValueError(
                f"get_range reads at most {defaults.MAX_JSON_BODY_BYTES} bytes, not {length}:"
                " use get_blob_to_file for large reads"
            )
        request = {"op": "get", "digest": digest, "offset": offset, "length": length}
        _, body = self._call(request)
        return body

    def verify(self, digests: list[str] | None = None) -> list[str]:
        """Re-hash blobs on the node (all if None); returns the digests that are bad
        (missing or not hashing to their name)."""
        batches = [None] if digests is None else _batches(digests, defaults.VERIFY_BATCH_DIGESTS)
        bad: list[str] = []
        with self._connection(timeout=max(self.timeout, defaults.VERIFY_TIMEOUT_S)) as sock:
            for batch in batches:
                wire.send_frame(sock, {"op": "verify", "digests": batch})
                _, body_len = wire.recv_response(sock, str(self.address))
                answer = protocol.decode_json(
                    wire.recv_body(sock, _bounded_body(body_len, self.address))
                )
                bad.extend(protocol.validate_digest_list(answer))
        return bad

    def scrub(self, *, start: bool = True) -> dict[str, Any]:
        """Ask the node to run a scrub pass (from its cursor) unless one is running (with
        start=False, only ask); its scrub status: running, after (cursor), rate_bps,
        scrubbed_bytes, passes, last_pass_finished, found_bad and quarantined (digests of
        bad copies held aside)."""
        answer = self._call_json({"op": "scrub", "start": start})
        if not isinstance(answer, dict):
            raise ProtocolError(f"node {self.address} sent a scrub status that is not an object")
        answer["quarantined"] = protocol.validate_digest_list(answer.get("quarantined"))
        return answer

    def discard(self, digest: str) -> bool:
        """Delete the node's quarantined copy of digest; False if it held none."""
        response, _ = self._call({"op": "discard", "digest": digest})
        return response.get("deleted") is True

    def delete(self, digest: str) -> bool:
        response, _ = self._call({"op": "delete", "digest": digest})
        return response.get("deleted") is True

    def replicate(self, digest: str, peer: NodeAddress, rate: int = 0) -> bool:
        """Ask this node to push its copy of digest to peer; True if peer stored it, False if
        it already had it. With a rate (bytes/s), the node paces the push on its repair
        bucket, which all its repair pushes share. However large the blob, each read waits
        one socket timeout: the node sends progress frames while it copies, so only a
        stalled copy times out."""
        request = {"op": "replicate", "digest": digest, "peer": str(peer)}
        if rate:
            request["rate"] = rate
        with self._connection() as sock:
            wire.send_frame(sock, request)
            response, body_len = wire.recv_final_response(sock, str(self.address))
            wire.recv_body(sock, _bounded_body(body_len, self.address))
        return response.get("status") == "stored"

    def replicate_batch(
        self, digests: list[str], peer: NodeAddress, rate: int = 0
    ) -> dict[str, str]:
        """Ask this node to push its copies of `digests` to peer over one connection, paced
        as replicate is; digest -> stored, exists, missing, mismatch or "failed: why", one
        for each digest asked. Progress frames keep each read to one socket timeout."""
        request: dict = {"op": "replicate_batch", "digests": digests, "peer": str(peer)}
        if rate:
            request["rate"] = rate
        with self._connection() as sock:
            wire.send_frame(sock, request)
            _, body_len = wire.recv_final_response(sock, str(self.address))
            answer = wire.recv_json_body(sock, body_len, what=f"answer from node {self.address}")
        if (
            not isinstance(answer, dict)
            or set(answer) != set(digests)
            or not all(isinstance(how, str) for how in answer.values())
        ):
            raise ProtocolError(
                f"node {self.address} answered replicate_batch without one outcome per blob"
            )
        return answer

    def put_manifest(self, key: str, data: bytes) -> None:
        """Put a manifest; one over a JSON body's limit goes in parts over one connection."""
        part = defaults.MAX_JSON_BODY_BYTES
        if len(data) <= part:
            self._call({"op": "manifest_put", "key": key}, data)
            return
        with self._connection() as sock:
            for offset in range(0, len(data), part):
                header = {"op": "manifest_put", "key": key, "offset": offset, "total": len(data)}
                wire.send_frame(sock, header, data[offset : offset + part])
                _, body_len = wire.recv_response(sock, str(self.address))
                wire.recv_body(sock, _bounded_body(body_len, self.address))

    def list_manifests(self, page_entries: int = defaults.LIST_PAGE_ENTRIES) -> list[str]:
        """Every manifest key the node holds, read in pages (see list_blobs)."""
        keys: list[str] = []
        for page in self._pages("manifest_list", page_entries):
            if not isinstance(page, list):
                raise ProtocolError(f"node {self.address} sent a manifest list that is not a list")
            keys.extend(protocol.validate_key(key) for key in page)
        return keys

    def delete_manifest(self, key: str) -> bool:
        response, _ = self._call({"op": "manifest_delete", "key": key})
        return response.get("deleted") is True

    def get_manifest(self, key: str) -> bytes:
        """A manifest's bytes, read in parts of at most one JSON body's limit. The size the
        node declares first holds for every part, and is at most MAX_MANIFEST_BYTES: a node
        cannot have us accumulate parts without end."""
        parts, offset, size = [], 0, None
        with self._connection() as sock:
            while size is None or offset < size:
                header = {"op": "manifest_get", "key": key, "offset": offset}
                wire.send_frame(sock, {**header, "length": defaults.MAX_JSON_BODY_BYTES})
                response, body_len = wire.recv_response(sock, str(self.address))
                declared = protocol.validate_length(response.get("size"), "size")
                if declared > defaults.MAX_MANIFEST_BYTES or size not in (None, declared):
                    raise ProtocolError(
                        f"node {self.address} declared manifest {key!r} as {declared} bytes"
                        + ("" if size is None else f" after {size}")
                        + f": over the {defaults.MAX_MANIFEST_BYTES} byte limit, or changing"
                    )
                size = declared
                parts.append(wire.recv_body(sock, _bounded_body(body_len, self.address)))
                if not parts[-1] and offset < size:
                    raise ProtocolError(f"node {self.address} sent an empty part of {key!r}")
                offset += len(parts[-1])
        return b"".join(parts)

    def get_manifests(
        self, keys: Sequence[str], window: int = defaults.MANIFEST_GET_WINDOW
    ) -> Iterator[tuple[str, bytes | SmoltorrentError]]:
        """(key, its manifest's bytes or the error reading it met) for every key, as
        get_manifest gives them, over one connection with up to `window` requests sent
        ahead of their answers: the node reads the next copies while this process parses
        the last (a connection and a wait per copy were a quarter of a rebuild's time,
        docs/benchmarks.md). A manifest larger than one answer is read afterwards on its
        own; once the connection fails, so is every key not answered yet: one copy's
        failure still costs only itself."""
        keys = list(keys)
        answered = 0
        larger: list[str] = []
        try:
            for key, data in self._manifests_in_a_row(keys, window):
                answered += 1
                if data is None:
                    larger.append(key)
                else:
                    yield key, data
        except SmoltorrentError:
            pass  # the connection is out of step or gone: the rest one by one
        for key in larger + keys[answered:]:
            try:
                yield key, self.get_manifest(key)
            except SmoltorrentError as exc:
                yield key, exc

    def _manifests_in_a_row(
        self, keys: list[str], window: int
    ) -> Iterator[tuple[str, bytes | SmoltorrentError | None]]:
        """get_manifests over one connection: each key's bytes, the error frame the node
        answered it with (an error frame has no body: the stream stays in step), or None
        for a manifest over one answer. Anything else raised ends the connection."""
        with self._connection() as sock:
            sent = 0
            for done, key in enumerate(keys):
                while sent < len(keys) and sent - done < window:
                    wire.send_frame(
                        sock,
                        {
                            "op": "manifest_get",
                            "key": keys[sent],
                            "offset": 0,
                            "length": defaults.MAX_JSON_BODY_BYTES,
                        },
                    )
                    sent += 1
                try:
                    response, body_len = wire.recv_response(sock, str(self.address))
                except NodeError as exc:
                    yield key, exc
                    continue
                size = protocol.validate_length(response.get("size"), "size")
                body = wire.recv_body(sock, _bounded_body(body_len, self.address))
                yield key, body if len(body) == size else None


def _bounded_body(body_len: int, address: NodeAddress) -> int:
    if body_len > defaults.MAX_JSON_BODY_BYTES:
        raise ProtocolError(
            f"node {address} announced a {body_len} byte answer, over the"
            f" {defaults.MAX_JSON_BODY_BYTES} byte limit for in-memory answers"
        )
    return body_len


def _batches(items: list[str], size: int) -> list[list[str]]:
    return [items[start : start + size] for start in range(0, len(items), size)] or [[]]
