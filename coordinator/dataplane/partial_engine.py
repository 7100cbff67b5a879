"""Partial gather: only the selected tensors of a version, as a .safetensors file of their own.

Each run of neighbouring selected tensors is one ranged read of its shard's blob, all
runs in parallel; the bytes are hashed tensor by tensor as they arrive and checked
against the per-tensor SHA-256 the manifest recorded at store time (schema 2), and
pwritten straight to their place in a temp file. A shard whose manifest has no
tensor digests (schema 1) is read whole and checked against its blob digest, the
only digest there is for it: a range of it could not be verified. A mismatch, a
wrong length or a node error moves to the next replica. As in a full gather, the
file is fsynced and renamed onto the destination only when every tensor is
verified; on failure nothing is left behind.

A chunked version (schema 3, the default) is cut at tensor boundaries, so its chunks are
the unit a partial load reads: each chunk holding a selected byte is read and decoded
whole, checked against both of its digests (the encoded copy's and the raw bytes'), and
only the selected ranges of its raw bytes are written; no other chunk is read. The report
names the chunks read, and counts their bytes as they came from the nodes.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from coordinator.dataplane.chunk_engine import decode_chunk_from
from coordinator.dataplane.node_client import KeptConnections, NodeClient
from coordinator.dataplane.replicas import BadCopy, Unanswered, first_intact, keeping
from coordinator.dataplane.staged_output import staged_output
from coordinator.plan.manifest import Manifest
from coordinator.plan.selection import Piece, Read, Selection
from smoltorrent import defaults
from smoltorrent.errors import DigestMismatchError, GatherError


@dataclass
class PartialReport:
    path: str
    size: int
    tensors: list[str]
    # bytes that came from the nodes, failed attempts included (of a chunked version: every
    # chunk read, as stored, encoded)
    bytes_fetched: int = 0
    whole_shards: list[int] = field(default_factory=list)  # read whole: no tensor digests
    chunks_read: list[int] = field(default_factory=list)  # of a chunked version
    chunks_total: int = 0  # of a chunked version: how many it has
    fallbacks: list[str] = field(default_factory=list)
    bad_copies: list[BadCopy] = field(default_factory=list)


class _Sink:
    """Takes a body chunk by chunk: writes the selected pieces to their place in the
    output, hashing each (ranged read) or the whole body (whole-blob read)."""

    def __init__(self, fd: int, pieces: Sequence[Piece], base: int, whole: bool) -> None:
        self.fd = fd
        self.base = base  # blob offset of the body's first byte
        self.pieces = pieces
        self.hashers = [hashlib.sha256() for _ in pieces]
        self.whole = hashlib.sha256() if whole else None
        self.position = base

    def __call__(self, chunk: memoryview) -> None:
        start, end = self.position, self.position + len(chunk)
        if self.whole is not None:
            self.whole.update(chunk)
        for piece, hasher in zip(self.pieces, self.hashers, strict=True):
            lo, hi = max(start, piece.blob_offset), min(end, piece.blob_offset + piece.length)
            if lo >= hi:
                continue
            part = chunk[lo - start : hi - start]
            hasher.update(part)
            _pwrite_all(self.fd, part, piece.out_offset + lo - piece.blob_offset)
        self.position = end

    def check(self, read: Read, digest: str, address: str) -> None:
        if self.whole is not None:
            if self.whole.hexdigest() != digest:
                raise DigestMismatchError(
                    f"blob {digest[:12]} from node {address} hashed to "
                    f"{self.whole.hexdigest()[:12]}: that copy is corrupt"
                )
            return
        for piece, hasher in zip(read.pieces, self.hashers, strict=True):
            if hasher.hexdigest() != piece.sha256:
                raise DigestMismatchError(
                    f"tensor {piece.name} from blob {digest[:12]} on node {address} hashed to "
                    f"{hasher.hexdigest()[:12]}, not its recorded {str(piece.sha256)[:12]}: "
                    "that copy is corrupt"
                )


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def gather_tensors(
    manifest: Manifest,
    selection: Selection,
    sources: Sequence[Sequence[NodeClient]],
    out_path: str | os.PathLike,
    *,
    threads: int = defaults.TRANSFER_THREADS,
    on_bad_copy: Callable[[BadCopy], None] | None = None,
) -> PartialReport:
    """Write the selected tensors of `manifest` to out_path as one .safetensors file;
    sources[i] lists shard i's replicas in the order to try them."""
    out_path = os.path.abspath(os.fspath(out_path))
    report = PartialReport(
        path=out_path,
        size=selection.size,
        tensors=selection.names,
        whole_shards=sorted(selection.whole_shards),
        chunks_read=[read.shard for read in selection.reads] if manifest.chunked else [],
        chunks_total=len(manifest.chunks) if manifest.chunked else 0,
    )
    lock = threading.Lock()
    unanswered = Unanswered()  # a node that did not answer one read is tried last after
    # Each thread keeps its connection to a node from one read to the next (a partial load
    # of a chunked version reads many chunks of a few MB, as a whole gather does).
    kept = KeptConnections()
    sources = keeping(sources, kept)

    def bad_copy(bad: BadCopy) -> None:
        with lock:
            report.bad_copies.append(bad)
        if on_bad_copy:
            on_bad_copy(bad)

    with kept, staged_output(out_path, selection.size, f"tensors of {manifest.name}") as fd:
        os.pwrite(fd, selection.prefix, 0)

        def received(n: int) -> None:
            with lock:
                report.bytes_fetched += n

        def one_read(read: Read) -> str | None:
            shard = manifest.entries[read.shard]
            whole = read.shard in selection.whole_shards
            start = 0 if whole else read.offset

            def fetch(client: NodeClient) -> None:
                if manifest.chunked:  # decoded whole, its selected ranges written out
                    decode_chunk_from(
                        client,
                        manifest.chunks[read.shard],
                        _Sink(fd, read.pieces, 0, False),
                        received,
                    )
                    return
                sink = _Sink(fd, read.pieces, start, whole)
                try:
                    client.read_blob(
                        shard.blob_sha256,
                        sink,
                        offset=start,
                        length=None if whole else read.length,
                        size=shard.blob_size,
                    )
                finally:  # bytes that came, whether the read then failed or not
                    with lock:
                        report.bytes_fetched += sink.position - start
                sink.check(read, shard.blob_sha256, str(client.address))

            served_by, tried = first_intact(
                read.shard, shard.blob_sha256, sources[read.shard], fetch, bad_copy, unanswered
            )
            if served_by is not None:
                with lock:
                    report.fallbacks.extend(f"shard {read.shard} {line}" for line in tried)
                return None
            names = ", ".join(p.name for p in read.pieces[:3])
            kind = "chunk" if manifest.chunked else "shard"
            return f"{kind} {read.shard} (tensors {names}): " + (
                "; ".join(tried) or "no node holds a copy"
            )

        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(selection.reads)))) as pool:
            missing = [m for m in pool.map(one_read, selection.reads) if m]
        if missing:
            raise GatherError(
                f"cannot load the selected tensors of {manifest.name} (version "
                f"{manifest.version_id[:12]}): {len(missing)} read(s) found no good replica: "
                + " | ".join(missing)
                + ". Bring a node holding them back (`smoltorrent status`) and load again."
            )
    return report
