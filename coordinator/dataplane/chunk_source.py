"""Where the bytes of one chunk's blob come from when a transfer sends it.

A RAW chunk is the source's own range (sent with sendfile; a version stored before RAW
chunks were bare has a chunk header in front, codec.raw_prefix). An
encoded chunk was written by the store into the spool, one file per chunk under
spool_dir(root, vkey) on the source's host; when that file is gone (the spool removed
after the chunk reached its nodes, a replay later, or a chunk the store found stored
whose copies were deleted since) it is encoded again from the source, which must give
the very blob the manifest names.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from typing import NoReturn

from coordinator.dataplane import codec
from coordinator.plan.blob_spans import BlobSpan
from coordinator.plan.chunks import ChunkPlan, plan_chunks
from coordinator.plan.manifest import Manifest
from coordinator.plan.manifest_entries import ChunkEntry
from coordinator.plan.safetensors_header import CheckpointHeader, read_header
from coordinator.plan.source_file import SourceIdentity
from coordinator.plan.version_ids import check_version_key
from smoltorrent.errors import SourceChangedError


def spool_dir(root: str | os.PathLike, vkey: str) -> str:
    """Where the encoded chunks of version `vkey` wait to be sent, on the source's host.
    The key comes from a task's arguments or Redis, and this directory is removed whole:
    UnsafeNameError unless it is a version key (os.path.join(root, "/home/u") is /home/u)."""
    return os.path.join(os.fspath(root), check_version_key(vkey))


def source_changed(path: str, index: int) -> NoReturn:
    raise SourceChangedError(
        f"{path} changed while chunk {index} was encoded; the partial version was"
        " abandoned. Store it again once training has finished writing it."
    )


def encode_one(
    path: str, header: CheckpointHeader, plan: ChunkPlan, spool: str | None
) -> tuple[tuple[str, str, int], BlobSpan]:
    """Encode one chunk into spool/<index>.chunk (RAW without a spool, or when no
    encoding gains); its (raw, blob) digests and blob size, and where to send it from."""
    offset = header.data_start + plan.data_start
    with open(path, "rb") as source:
        source.seek(offset)
        if spool is None:
            result = codec.raw_chunk(source, plan.size)
        else:
            spooled = os.path.join(spool, f"{plan.index}.chunk")
            with open(spooled, "w+b") as sink:
                result = codec.encode_chunk(source, plan.size, plan.layout, sink)
            if result.encoding == codec.RAW:
                os.unlink(spooled)  # empty: a RAW chunk is sent from the source
    digests = (result.raw_sha256, result.sha256, result.size)
    if result.encoding == codec.RAW:
        return digests, BlobSpan(plan.index, result.sha256, result.size, b"", offset, plan.size)
    return digests, BlobSpan(
        plan.index, result.sha256, result.size, b"", offset, plan.size, spool=spooled
    )


def chunk_span(manifest: Manifest, chunk: ChunkEntry, spool: str) -> BlobSpan:
    """What sending one chunk's blob takes, from the manifest: a RAW chunk is the source's
    range (behind its header, in a version stored before RAW chunks were bare); an
    encoded one is the file `spool`/<index>.chunk, encoded again from the source when it
    is not there ("" : nowhere yet)."""
    offset = manifest.data_start + chunk.data_start
    length = chunk.data_end - chunk.data_start
    prefix = codec.raw_prefix(chunk.blob_size, length)
    if prefix is not None:
        return BlobSpan(chunk.index, chunk.blob_sha256, chunk.blob_size, prefix, offset, length)
    at = os.path.join(spool, f"{chunk.index}.chunk") if spool else ""
    return BlobSpan(chunk.index, chunk.blob_sha256, chunk.blob_size, b"", offset, length, at)


def chunk_spans(manifest: Manifest, spool: str = "") -> tuple[BlobSpan, ...]:
    return tuple(chunk_span(manifest, chunk, spool) for chunk in manifest.chunks)


def sendable(
    path: str, identity: SourceIdentity, span: BlobSpan, spool: str | os.PathLike
) -> tuple[str, SourceIdentity, BlobSpan]:
    """The file, its identity and the span to send a blob from, as send_shard and the
    chain take them: a shard or RAW chunk from the source itself; an encoded chunk from
    its spooled file, encoded again from the source into `spool` when that file is gone
    (a replay after the store's spool was removed, or a chunk the store found stored
    whose copies were deleted since). SourceChangedError when the source no longer
    encodes to the blob."""
    if span.spool is None:
        return path, identity, span
    at = span.spool
    if not (at and _has_size(at, span.size)):
        at = _encode_again(path, identity, span, os.fspath(spool))
    literal = BlobSpan(span.index, span.digest, span.size, b"", 0, span.size)
    return at, SourceIdentity.of(at), literal


def _has_size(path: str, size: int) -> bool:
    try:
        return os.stat(path).st_size == size
    except FileNotFoundError:
        return False


def _encode_again(path: str, identity: SourceIdentity, span: BlobSpan, spool: str) -> str:
    identity.check(path)
    header = read_header(path)
    plans = plan_chunks(header)
    plan = plans[span.index] if span.index < len(plans) else None
    if plan is None or (header.data_start + plan.data_start, plan.size) != (
        span.offset,
        span.length,
    ):
        source_changed(path, span.index)
    os.makedirs(spool, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="again-", dir=spool)
    try:
        (_, blob, _), encoded = encode_one(path, header, plan, scratch)
        identity.check(path)
        if blob != span.digest or encoded.spool is None:
            # Other bytes, or this smoltorrent encodes them otherwise than the one that
            # stored the chunk: a store of the file now makes its own chunks.
            source_changed(path, span.index)
        at = os.path.join(spool, f"{span.index}.chunk")
        os.replace(encoded.spool, at)
        return at
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def release(span: BlobSpan, spool: str) -> None:
    """Drop a chunk's spooled file once its nodes hold it (and its version's spool
    directory `spool` with the last one): a later send encodes it again if it must. The
    file is spool/<index>.chunk, where the store put it: the span's own path came from
    Redis, and no Redis value names a file to delete."""
    if not span.spool:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(spool, f"{span.index}.chunk"))
    with contextlib.suppress(OSError):  # not empty yet: other chunks are still to send
        os.rmdir(spool)


def clear_spool(root: str | os.PathLike, keep: set[str], older_than: float) -> int:
    """Remove the spool directories under root, but those of the versions in `keep` (still
    pending) and any changed within `older_than` seconds (a store preparing one now);
    how many."""
    removed = 0
    now = time.time()
    with contextlib.suppress(FileNotFoundError), os.scandir(root) as entries:
        for entry in entries:
            if entry.name in keep or not entry.is_dir(follow_symlinks=False):
                continue
            if now - entry.stat(follow_symlinks=False).st_mtime < older_than:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed
