"""The raw reference: the same byte ranges moved with nothing but sendfile, recv and pwrite.

A "raw node" (`python -m bench.raw_reference serve DIR`) is a plain socket
server in its own process: `put` writes what it receives to DIR/NAME and
fsyncs it, `get` sends DIR/NAME back with os.sendfile. No hashing, no
framing beyond one small JSON header, no authentication: the floor that
smoltorrent's store and gather are measured against.

With `hashed`, the same moves plus the one integrity check smoltorrent cannot drop: the
source hashes each range once (SHA-256) before it sends, a node hashes what it receives,
and a gather hashes what it pulls. Nothing else is added (no framing, temp files, renames
or directory fsyncs), so the gap between raw and hashed is what hashing costs on this
machine, and the gap above hashed is smoltorrent's own overhead.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import socketserver
import struct
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

from smoltorrent import defaults

_LEN = struct.Struct("<Q")
BUFFER_BYTES = defaults.IO_CHUNK_BYTES  # same fixed buffer size as the real engines


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed early")
        data += chunk
    return bytes(data)


def _send_header(sock: socket.socket, header: dict) -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)


def _recv_header(sock: socket.socket) -> dict:
    return json.loads(_recv_exact(sock, _recv_exact_len(sock)))


def _recv_exact_len(sock: socket.socket) -> int:
    return _LEN.unpack(_recv_exact(sock, _LEN.size))[0]


def _sendfile_all(sock: socket.socket, fd: int, offset: int, count: int) -> None:
    # Blocking socket: os.sendfile moves everything or raises; loop only for short sends.
    while count:
        sent = os.sendfile(sock.fileno(), fd, offset, min(count, defaults.SENDFILE_MAX_BYTES))
        if sent == 0:
            raise ConnectionError("source file ended early")
        offset, count = offset + sent, count - sent


def _recv_into_fd(
    sock: socket.socket, fd: int, offset: int, count: int, hasher: hashlib._Hash | None = None
) -> None:
    """recv into one fixed buffer, pwrite at offset: what the real engines do, hashing only
    when given a hasher."""
    buf = bytearray(BUFFER_BYTES)
    view = memoryview(buf)
    while count:
        n = sock.recv_into(view[: min(count, len(buf))])
        if not n:
            raise ConnectionError("peer closed early")
        if hasher is not None:
            hasher.update(view[:n])
        done = 0
        while done < n:
            done += os.pwrite(fd, view[done:n], offset + done)
        offset, count = offset + n, count - n


# --- the raw node process ------------------------------------------------------


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        header = _recv_header(sock)
        path = Path(self.server.data_dir) / os.path.basename(header["name"])
        if header["op"] == "put":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                hasher = hashlib.sha256() if header.get("hashed") else None
                _recv_into_fd(sock, fd, 0, header["length"], hasher)
                os.fsync(fd)  # the real node fsyncs every blob before answering
            finally:
                os.close(fd)
            sock.sendall(b"ok")
        elif header["op"] == "get":
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                sock.sendall(_LEN.pack(size))
                _sendfile_all(sock, fd, 0, size)
            finally:
                os.close(fd)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = defaults.LISTEN_BACKLOG


def serve(data_dir: str) -> None:
    os.makedirs(data_dir, exist_ok=True)
    with _Server(("127.0.0.1", 0), _Handler) as server:
        server.data_dir = data_dir
        print(server.server_address[1], flush=True)  # the parent reads the port from stdout
        server.serve_forever()


# --- the client side, run inside a measured child process -------------------------


def raw_store(
    source: str,
    ranges: Sequence[tuple[int, int]],
    targets: Sequence[Sequence[int]],
    ports: Sequence[int],
    threads: int = defaults.TRANSFER_THREADS,
    hashed: bool = False,
) -> int:
    """Send range i to every node in targets[i], every (shard, replica) at once from the
    source, like store_checkpoint's default (no chain); returns the bytes moved. `hashed`:
    every range hashed once at the source first, and at every node as it arrives."""
    if hashed:
        # The store's own read-and-hash pass (imported here: a raw node never needs it).
        from coordinator.dataplane.store_engine import hash_blob

        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(lambda i: hash_blob(source, i, b"", *ranges[i]), range(len(ranges))))

    def one_copy(job: tuple[int, int]) -> int:
        index, node = job
        offset, length = ranges[index]
        with open(source, "rb") as f, socket.create_connection(("127.0.0.1", ports[node])) as sock:
            header = {"op": "put", "name": f"shard{index}", "length": length, "hashed": hashed}
            _send_header(sock, header)
            _sendfile_all(sock, f.fileno(), offset, length)
            if _recv_exact(sock, 2) != b"ok":
                raise ConnectionError(f"raw node {node} did not confirm shard {index}")
        return length

    jobs = [(index, node) for index, nodes in enumerate(targets) for node in nodes]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(one_copy, jobs))


def raw_gather(
    source: str,
    out: str,
    size: int,
    header_len: int,
    ranges: Sequence[tuple[int, int]],
    served_by: Sequence[int],
    ports: Sequence[int],
    threads: int = defaults.TRANSFER_THREADS,
    hashed: bool = False,
) -> dict:
    """Pull each range from one node into a preallocated file at its offset, hashing each
    as it arrives when `hashed`.

    Returns the bytes moved and where the time went (preallocate, transfer, fsync).
    """
    marks = [time.perf_counter()]
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        with open(source, "rb") as f:  # the header travels in the manifest in the real gather
            os.pwrite(fd, f.read(header_len), 0)
        marks.append(time.perf_counter())

        def one_shard(index: int) -> int:
            offset, length = ranges[index]
            with socket.create_connection(("127.0.0.1", ports[served_by[index]])) as sock:
                _send_header(sock, {"op": "get", "name": f"shard{index}"})
                if _recv_exact_len(sock) != length:
                    raise ConnectionError(f"raw node sent a wrong length for shard {index}")
                _recv_into_fd(sock, fd, offset, length, hashlib.sha256() if hashed else None)
            return length

        with ThreadPoolExecutor(max_workers=threads) as pool:
            moved = sum(pool.map(one_shard, range(len(ranges))))
        marks.append(time.perf_counter())
        os.fsync(fd)
        marks.append(time.perf_counter())
    finally:
        os.close(fd)
    steps = zip(("preallocate_s", "transfer_s", "fsync_s"), pairwise(marks), strict=True)
    return {"bytes": moved, **{step: round(b - a, 3) for step, (a, b) in steps}}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        sys.exit("usage: python -m bench.raw_reference serve DATA_DIR")
    serve(sys.argv[2])
