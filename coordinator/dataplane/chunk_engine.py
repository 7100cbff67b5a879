"""Store and gather in chunks: encoded on the way to the nodes, decoded on the way back.

A chunked version (manifest schema 3) keeps each chunk of the data section as one blob:
the chunk encoded (coordinator/dataplane/codec.py), named by the SHA-256 of the encoded
bytes, which is what a node verifies on every put and scrub; it never decodes. The store
encodes each new chunk once, into a spool file beside the others of this store, and
sends it with sendfile; a chunk no encoding shrinks is sent as its RAW header followed by
the source's own bytes. A chunk whose raw digest is already known to be stored (a
fine-tune's unchanged tensors) is never encoded nor sent again.

The gather decodes each chunk as its bytes arrive, writes the raw bytes at its offset and
checks both digests: the encoded one (the node's copy is what it should be) and the raw
one (the decode gave the source's bytes). A copy failing either is a bad copy, and the
next replica is read, as for whole shards.

Plain Python, no Celery and no Redis: the store task (tasks/store.py) prepares a chunked
version here and its transfers send each chunk with `sendable`; `store_chunked` runs the
whole store for scripts, tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from coordinator.dataplane import codec
from coordinator.dataplane.chunk_source import (
    chunk_span,
    encode_one,
    sendable,
    source_changed,
    spool_dir,
)
from coordinator.dataplane.digest_cache import DigestCache
from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.dataplane.ordered_map import ordered_map
from coordinator.dataplane.replicas import BadCopy, Unanswered, first_intact
from coordinator.dataplane.store_engine import hash_blob, probe_nodes, send_shard, write_manifest
from coordinator.plan.blob_spans import BlobSpan
from coordinator.plan.chunks import ChunkPlan, plan_chunks
from coordinator.plan.manifest import SCHEMA_VERSION, Manifest
from coordinator.plan.manifest_entries import ChunkEntry, chunk_entries
from coordinator.plan.placement import place
from coordinator.plan.safetensors_header import CheckpointHeader, read_header
from coordinator.plan.source_file import SourceIdentity
from coordinator.plan.version_ids import chunked_version_id
from smoltorrent import defaults
from smoltorrent.errors import (
    ChunkFormatError,
    DigestMismatchError,
    ManifestError,
    NodeError,
    NodeUnavailableError,
    ProtocolError,
    SmoltorrentError,
)
from worker_server import writeback

# A chunk as a store looks it up: (raw SHA-256, encoding), the encoding being
# codec.encoding_of its layout: the same raw bytes grouped otherwise are another blob.
ChunkKey = tuple[str, str]
# chunk key -> (blob SHA-256, blob size) of chunks already stored as this store would
# encode them again
KnownChunks = Mapping[ChunkKey, tuple[str, int]]
# Given every chunk's key, the ones already stored (Redis's chunks room, for the tasks):
# those are neither encoded nor sent again.
Lookup = Callable[[Sequence[ChunkKey]], KnownChunks]


@dataclass(frozen=True)
class PreparedChunks:
    """A planned, encoded and placed chunked version, before any byte is sent."""

    path: str
    manifest: Manifest
    spans: tuple[BlobSpan, ...]  # what sending each chunk takes (sendable() reads them)
    targets: tuple[tuple[str, ...], ...]  # per chunk, the node ids chosen for it
    identity: SourceIdentity
    spool: str  # this version's encoded chunks: remove it once they are on the nodes
    # Per chunk, the encoding its blob was made with (codec.blob_encoding): what Redis's
    # chunks room records, so a later store counts on the blob only if it would make the
    # same one. A few distinct texts, shared.
    encodings: tuple[str, ...] = ()
    encoded_raw_bytes: int = 0  # raw bytes this store encoded or hashed RAW (not known)
    known: frozenset[int] = frozenset()  # chunks already stored: never encoded here
    hashed_bytes: int = 0  # source bytes read at plan time (0: cached digests, all stored)
    # Tensors in the source's header, counted at plan time: the version's listing row says
    # it, and parsing the header again for it was the largest part of a store's peak.
    tensor_count: int = 0

    @property
    def vkey(self) -> str:
        return self.manifest.storage_key()


def _raw_digest(path: str, header: CheckpointHeader, plan: ChunkPlan) -> str:
    return hash_blob(path, plan.index, b"", header.data_start + plan.data_start, plan.size)


def prepare_chunked_store(
    path: str | os.PathLike,
    name: str,
    free_bytes: Mapping[str, int],
    spool: str | os.PathLike,
    *,
    replicas: int = defaults.DEFAULT_REPLICAS,
    place_replicas: int | None = None,
    lookup: Lookup | None = None,
    encode: bool = True,
    threads: int = defaults.HASH_THREADS,
    digest_cache: DigestCache | None = None,
) -> PreparedChunks:
    """Plan the chunks, encode the ones `lookup` does not know (threads at once: zstd and
    hashlib release the GIL) into spool_dir(spool, vkey), place every chunk.

    With `lookup`, every chunk is hashed first and only the unknown ones are encoded.
    Without `encode`, every new chunk is RAW (for a link faster than the encoder): hashed
    once, never spooled. `place_replicas` below `replicas` stores under-replicated on
    purpose (fewer live nodes than R), as prepare_store does. With `digest_cache`, the raw
    digests of an unchanged file are not read again: a chunk `lookup` knows is then never
    read at all."""
    path = os.fspath(path)
    identity = SourceIdentity.of(path)
    header = read_header(path)
    identity.check(path)
    plans = plan_chunks(header)
    encodings = [codec.encoding_of(plan.layout) for plan in plans]
    tensor_count = len(header.tensors)
    # Planned: from here on only the header's bytes and offsets are read. Its thousands of
    # tensors go now instead of staying through the encoding and the task after it.
    header = dataclasses.replace(header, tensors=())
    key = DigestCache.chunks_key(os.stat(path), plans) if digest_cache else ""
    cached = digest_cache.get(key) if digest_cache else None
    cached_raws = [raw for raw, _ in cached] if cached and len(cached) == len(plans) else None
    os.makedirs(spool, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="store-", dir=spool)
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            if lookup is not None and encode and cached_raws is None:
                # New content, or a rewrite: hashed and encoded as the lookup finds it.
                encoded = _encode_as_found(path, header, plans, encodings, scratch, lookup, pool)
                full_pass = True
            else:
                encoded, full_pass = _encode_known(
                    path, header, plans, encodings, scratch, lookup, encode, cached_raws, pool
                )
        identity.check(path)
        digests = [digest for digest, _ in encoded]
        if digest_cache and DigestCache.chunks_key(os.stat(path), plans) == key:
            digest_cache.put(key, [(raw, ()) for raw, _, _ in digests])
        manifest = Manifest(
            name=name,
            version_id=chunked_version_id(header.header_bytes, [raw for raw, _, _ in digests]),
            source_size=header.file_size,
            header_bytes=header.header_bytes,
            replicas=replicas,
            shards=(),
            created_at=time.time(),
            schema_version=SCHEMA_VERSION,
            chunks=chunk_entries(plans, digests),
        )
        # Placed before the chunks leave the scratch directory: a placement that fails
        # (no room) leaves no spool behind, where nothing would ever send from it.
        size_of = [size for _, _, size in digests]
        places = place(size_of, free_bytes, place_replicas or replicas) if plans else []
        kept = spool_dir(spool, manifest.storage_key())
        os.makedirs(kept, exist_ok=True)
        spans = []
        for chunk, (_, span) in zip(manifest.chunks, encoded, strict=True):
            if span is None:  # known: a holder passes it on (or it is encoded again)
                span = chunk_span(manifest, chunk, "")
            elif span.spool:
                # Same bytes as any spooled copy already there (a store of the same
                # content at once): the rename replaces it whole.
                os.replace(span.spool, os.path.join(kept, os.path.basename(span.spool)))
                span = chunk_span(manifest, chunk, kept)
            spans.append(span)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    encoded_raw_bytes = sum(p.size for p, (_, s) in zip(plans, encoded, strict=True) if s)
    # A blob's first chunk made it, with its own layout (the others name it: the same raw
    # bytes, known or encoded there).
    made: dict[str, str] = {}
    for chunk in manifest.chunks:
        made.setdefault(
            chunk.blob_sha256,
            codec.blob_encoding(
                chunk.blob_size, chunk.data_end - chunk.data_start, encodings[chunk.index]
            ),
        )
    return PreparedChunks(
        path=path,
        manifest=manifest,
        spans=tuple(spans),
        targets=tuple(tuple(t) for t in places),
        identity=identity,
        spool=kept,
        encodings=tuple(made[chunk.blob_sha256] for chunk in manifest.chunks),
        encoded_raw_bytes=encoded_raw_bytes,
        known=frozenset(i for i, (_, s) in enumerate(encoded) if s is None),
        hashed_bytes=header.data_size if full_pass else encoded_raw_bytes,
        tensor_count=tensor_count,
    )


def _encode_known(
    path: str,
    header: CheckpointHeader,
    plans: Sequence[ChunkPlan],
    encodings: Sequence[str],
    scratch: str,
    lookup: Lookup | None,
    encode: bool,
    cached_raws: list[str] | None,
    pool: ThreadPoolExecutor,
) -> tuple[list[tuple[tuple[str, str, int], BlobSpan | None]], bool]:
    """Every chunk's digests and span (None: stored already, or an earlier chunk's bytes)
    when the raw digests come first: cached, every chunk RAW (both digests in one pass),
    or no lookup at all; and whether every chunk was read (no cached raw digests)."""
    full_pass = False
    hashed: list[tuple[tuple[str, str, int], BlobSpan] | None] = [None] * len(plans)
    known: KnownChunks = {}
    if lookup is not None:
        if cached_raws is not None:  # unchanged since: read only what is new
            raws = cached_raws
        else:  # RAW chunks (not encode): both digests in the one pass
            hashed = list(ordered_map(pool, lambda p: encode_one(path, header, p, None), plans))
            raws = [h[0][0] for h in hashed]
            full_pass = True
        known = lookup(list(zip(raws, encodings, strict=True)))
        # A chunk whose bytes an earlier one of this version repeats (every norm
        # at ones) is encoded once, as that one: the store sends its blob once.
        first = {}
        repeats = {
            p.index: first[raws[p.index]]
            for p in plans
            if first.setdefault(raws[p.index], p.index) != p.index
        }
    else:
        repeats = {}

    def one(plan: ChunkPlan) -> tuple[tuple[str, str, int], BlobSpan | None] | None:
        done = hashed[plan.index]
        raw = done[0][0] if done else None
        if raw is None and lookup is not None:
            raw = raws[plan.index]
        if (raw, encodings[plan.index]) in known:
            blob, size = known[raw, encodings[plan.index]]
            return (raw, blob, size), None
        if done is not None:
            return done
        if plan.index in repeats:
            return None  # its first chunk's blob, filled in below
        digests, span = encode_one(path, header, plan, scratch if encode else None)
        if raw is not None and digests[0] != raw:
            source_changed(path, plan.index)
        return digests, span

    encoded = list(ordered_map(pool, one, plans))
    for index, earlier in repeats.items():
        encoded[index] = encoded[index] or (encoded[earlier][0], None)
    return encoded, full_pass


class _Seen:
    """What the chunks hashed so far say of the content, shared by _encode_as_found's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.new_in_a_row = 0  # chunks in a row the lookup did not know
        self.first: dict[str, int] = {}  # raw digest -> the lowest chunk index seen with it

    def one_pass(self) -> bool:
        with self.lock:
            return self.new_in_a_row >= defaults.CHUNKS_NEW_BEFORE_ONE_PASS

    def found(self, known: bool) -> None:
        with self.lock:
            self.new_in_a_row = 0 if known else self.new_in_a_row + 1

    def claim(self, raw: str, index: int) -> bool:
        """Whether an earlier chunk has these bytes (this one is then not encoded)."""
        with self.lock:
            earlier = self.first.get(raw, index)
            self.first[raw] = min(earlier, index)
            return earlier < index


def _encode_as_found(
    path: str,
    header: CheckpointHeader,
    plans: Sequence[ChunkPlan],
    encodings: Sequence[str],
    scratch: str,
    lookup: Lookup,
    pool: ThreadPoolExecutor,
) -> list[tuple[tuple[str, str, int], BlobSpan | None]]:
    """Every chunk's digests and span (None: stored already, or the same bytes as an
    earlier chunk, which keeps the one spooled copy), asking `lookup` chunk by chunk.

    A chunk is hashed first and encoded only if the lookup does not know it, until
    CHUNKS_NEW_BEFORE_ONE_PASS chunks in a row were new: the content is new, and the next
    chunks are encoded at once and looked up after, each read once, its bytes in cache
    for both digests. One found stored after all (its encoding dropped) goes back to
    hashing first."""
    seen = _Seen()

    def one(plan: ChunkPlan) -> tuple[str, tuple[tuple[str, str, int], BlobSpan | None] | None]:
        if seen.one_pass():
            digests, span = encode_one(path, header, plan, scratch)
            raw = digests[0]
            key = (raw, encodings[plan.index])
            known = lookup([key])
            seen.found(key in known)
            if key in known:
                _drop(span)
                return raw, ((raw, *known[key]), None)
            seen.claim(raw, plan.index)
            return raw, (digests, span)
        raw = _raw_digest(path, header, plan)
        key = (raw, encodings[plan.index])
        known = lookup([key])
        seen.found(key in known)
        if key in known:
            return raw, ((raw, *known[key]), None)
        if seen.claim(raw, plan.index):
            return raw, None  # an earlier chunk's bytes: it is encoded there
        digests, span = encode_one(path, header, plan, scratch)
        if digests[0] != raw:
            source_changed(path, plan.index)
        return raw, (digests, span)

    done = list(ordered_map(pool, one, plans))
    # Chunks of one content encoded each (found at once by two threads, or in one pass):
    # the lowest index keeps its copy, which it always has (a chunk skips encoding only
    # for a lower one), and the others name its blob.
    first = {}
    out: list[tuple[tuple[str, str, int], BlobSpan | None]] = []
    for index, (raw, result) in enumerate(done):
        keeper = first.setdefault(raw, index)
        if keeper == index:
            out.append(result)
            continue
        if result is not None:
            _drop(result[1])
        out.append((done[keeper][1][0], None))
    return out


def _drop(span: BlobSpan | None) -> None:
    """Remove a chunk's spooled encoding that will not be sent."""
    if span is not None and span.spool:
        os.unlink(span.spool)


@dataclass
class ChunkStoreResult:
    manifest: Manifest
    holders: dict[int, list[str]] = field(default_factory=dict)  # chunk -> node ids
    errors: list[str] = field(default_factory=list)
    bytes_sent: int = 0  # blob bytes that moved, from the coordinator or node to node
    encoded_raw_bytes: int = 0  # raw bytes this store encoded


def store_chunked(
    path: str | os.PathLike,
    addresses: Sequence[NodeAddress],
    spool: str | os.PathLike,
    *,
    name: str | None = None,
    replicas: int = defaults.DEFAULT_REPLICAS,
    known: Mapping[str, tuple[str, int]] | None = None,
    encode: bool = True,
    cluster_key: bytes | None = None,
    threads: int = defaults.TRANSFER_THREADS,
) -> ChunkStoreResult:
    """Store a checkpoint in chunks on the given nodes without Celery.

    A chunk a node already holds is kept there; one the store did not encode (`known`:
    raw digest -> blob of chunks stored by an earlier call, of the same layouts) is
    copied node to node from a holder. The manifest goes to every node holding one
    of its chunks."""
    path = os.fspath(path)
    by_address = {str(a): a for a in addresses}
    stats = probe_nodes(by_address, cluster_key)
    ids = {stat.node_id: by_address[addr] for addr, stat in stats.items()}
    clients = {n: NodeClient(a, cluster_key=cluster_key) for n, a in ids.items()}
    # Only a chunk some node still holds can be left unencoded: it is copied from there.
    on_nodes = set().union(*_held({b for b, _ in (known or {}).values()}, clients).values())
    known = {raw: blob for raw, blob in (known or {}).items() if blob[0] in on_nodes}
    prepared = prepare_chunked_store(
        path,
        name or os.path.basename(path),
        {stat.node_id: stat.free_bytes for stat in stats.values()},
        spool,
        replicas=replicas,
        lookup=(lambda keys: {k: known[k[0]] for k in keys if k[0] in known}) if known else None,
        encode=encode,
    )
    manifest = prepared.manifest
    result = ChunkStoreResult(
        manifest,
        holders={c.index: [] for c in manifest.chunks},
        encoded_raw_bytes=prepared.encoded_raw_bytes,
    )
    lock = threading.Lock()

    held = _held({c.blob_sha256 for c in manifest.chunks}, clients)

    def one(chunk: ChunkEntry) -> None:
        holding = sorted(n for n, blobs in held.items() if chunk.blob_sha256 in blobs)
        wanted = prepared.targets[chunk.index]
        targets = holding[: len(wanted)]
        targets += [n for n in wanted if n not in targets][: len(wanted) - len(targets)]
        for node_id in targets:
            if node_id in holding:
                with lock:
                    result.holders[chunk.index].append(node_id)
                continue
            try:
                source, identity, span = sendable(
                    path, prepared.identity, prepared.spans[chunk.index], prepared.spool
                )
                how = send_shard(
                    source, identity, span, clients[node_id], [clients[h] for h in holding]
                )
            except (NodeUnavailableError, NodeError, ProtocolError, DigestMismatchError) as exc:
                with lock:
                    result.errors.append(f"chunk {chunk.index} -> node {node_id}: {exc}")
                continue
            with lock:
                result.holders[chunk.index].append(node_id)
                result.bytes_sent += chunk.blob_size if how != "exists" else 0
            holding.append(node_id)

    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(one, manifest.chunks))
    finally:
        shutil.rmtree(prepared.spool, ignore_errors=True)
    missing = [i for i, h in result.holders.items() if not h]
    if missing:
        raise SmoltorrentError(
            f"{path}: chunk(s) {missing} reached no node ({'; '.join(result.errors)}). "
            "Nothing was committed; check the nodes with `smoltorrent status` and store again."
        )
    holders = {n for h in result.holders.values() for n in h}
    write_manifest(manifest, [clients[n] for n in holders])
    return result


def _held(blobs: set[str], clients: Mapping[str, NodeClient]) -> dict[str, set[str]]:
    """Which of the blobs each node holds (none, for a node that does not answer)."""
    digests = sorted(blobs)

    def one(node_id: str) -> set[str]:
        try:
            return clients[node_id].has(digests) if digests else set()
        except (NodeUnavailableError, NodeError, ProtocolError):
            return set()

    if not clients:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(clients))) as pool:
        return dict(zip(clients, pool.map(one, clients), strict=True))


def gather_chunks(
    manifest: Manifest,
    sources: Sequence[Sequence[NodeClient]],
    fd: int,
    *,
    threads: int = defaults.TRANSFER_THREADS,
    progress: Callable[[int], None] | None = None,
    on_bad_copy: Callable[[BadCopy], None],
    unanswered: Unanswered | None = None,
) -> tuple[dict[int, str], list[str], list[str]]:
    """Write every chunk of a chunked manifest's data section into fd at its offset;
    sources[i] lists chunk i's replicas in the order to try them (a node that did not
    answer an earlier chunk last). Returns which node served each chunk, one line per
    replica that failed, one line per chunk none served."""
    unanswered = unanswered or Unanswered()
    served: dict[int, str] = {}
    fallbacks: list[str] = []
    lock = threading.Lock()
    # The disk writes the chunks while more arrive: the final fsync finds little left.
    written = writeback.Scattered(fd)

    for chunk in manifest.chunks:  # before a byte is read or written
        check_raw_chunk(chunk)

    def one(chunk: ChunkEntry) -> str | None:
        def read(client: NodeClient) -> None:
            at = manifest.data_start + chunk.data_start
            if codec.raw_prefix(chunk.blob_size, chunk.data_end - chunk.data_start) == b"":
                # A bare RAW chunk: its blob is its raw bytes, received as a shard is
                # (hashed and written in one loop); check_raw_chunk made its blob digest
                # its raw digest, so the one check vouches for both. A RAW chunk behind a
                # header (older versions) is decoded: its raw digest is checked there.
                client.get_blob_to_file(
                    chunk.blob_sha256, fd, at, size=chunk.blob_size, progress=progress
                )
                return
            _read_chunk(client, chunk, fd, at, progress)

        by, tried = first_intact(
            chunk.index, chunk.blob_sha256, sources[chunk.index], read, on_bad_copy, unanswered
        )
        with lock:
            fallbacks.extend(f"chunk {chunk.index} {line}" for line in tried)
            if by is not None:
                served[chunk.index] = by
        if by is not None:
            written.wrote(chunk.data_end - chunk.data_start)
            return None
        where = "; ".join(tried) or "no node holds a copy"
        return f"chunk {chunk.index} ({chunk.blob_sha256[:12]}): {where}"

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        missing = [m for m in ordered_map(pool, one, manifest.chunks) if m]
    return served, fallbacks, missing


def check_raw_chunk(chunk: ChunkEntry) -> None:
    """A bare RAW chunk's blob is its raw bytes, so its blob digest is its raw digest. A
    manifest naming another blob for it (a hostile copy, Redis edited by hand) names bytes
    that are not the chunk's, whose own digest holds: ManifestError before a byte is read
    (not a bad copy: the node's copy is what it is asked for)."""
    if chunk.blob_size == chunk.data_end - chunk.data_start and (
        chunk.blob_sha256 != chunk.raw_sha256
    ):
        raise ManifestError(
            f"the manifest does not hold up: chunk {chunk.index} is stored RAW (its blob is"
            f" as large as its bytes) but names blob {chunk.blob_sha256[:12]} for raw bytes"
            f" {chunk.raw_sha256[:12]}, and a RAW blob is its raw bytes. Nothing was written."
        )


def _read_chunk(
    client: NodeClient,
    chunk: ChunkEntry,
    fd: int,
    offset: int,
    progress: Callable[[int], None] | None,
) -> None:
    """Decode one replica's copy into [offset, offset + raw size) of fd, both digests
    checked; a copy failing either, or not decoding, raises DigestMismatchError."""
    written = 0

    def write(piece: memoryview) -> None:
        nonlocal written
        os.pwrite(fd, piece, offset + written)
        written += len(piece)
        if progress:
            progress(len(piece))

    decode_chunk_from(client, chunk, write)


def decode_chunk_from(
    client: NodeClient,
    chunk: ChunkEntry,
    write: Callable[[memoryview], object],
    received: Callable[[int], object] | None = None,
) -> None:
    """Read one replica's copy of a chunk and pass its raw bytes to write(), in order, a
    piece at a time as they decode; both digests checked at the end, so a caller keeps
    nothing of a copy that raises DigestMismatchError (bad bytes, or not decoding).
    received(n): n bytes of the copy (encoded, as stored) came from the node."""
    check_raw_chunk(chunk)
    raw_size = chunk.data_end - chunk.data_start
    encoded, raw = hashlib.sha256(), hashlib.sha256()
    written = 0
    prefix = codec.raw_prefix(chunk.blob_size, raw_size)

    def out(piece: memoryview) -> None:
        nonlocal written
        if written + len(piece) > raw_size:
            raise ChunkFormatError(f"it decodes to more than its {raw_size} bytes")
        raw.update(piece)
        write(piece)
        written += len(piece)

    if prefix == b"":  # a bare RAW chunk: its bytes are the raw bytes, its digest the raw one
        encoded, take, finish = raw, out, None
    else:  # encoded, or RAW behind its header: the decoder reads the header
        decoder = codec.ChunkDecoder(chunk.blob_size, out, raw_length=raw_size)
        finish = decoder.finish

        def take(piece: memoryview) -> None:
            encoded.update(piece)
            decoder.feed(piece)

    def arrive(piece: memoryview) -> None:
        if received is not None:
            received(len(piece))
        take(piece)

    where = f"chunk {chunk.index} ({chunk.blob_sha256[:12]}) from node {client.address}"
    try:
        client.read_blob(chunk.blob_sha256, arrive, size=chunk.blob_size)
        if finish is not None:
            finish()
    except ChunkFormatError as exc:
        raise DigestMismatchError(f"{where}: {exc}") from exc
    if encoded.hexdigest() != chunk.blob_sha256:
        raise DigestMismatchError(f"{where} hashed to {encoded.hexdigest()[:12]}: a bad copy")
    if written != raw_size or raw.hexdigest() != chunk.raw_sha256:
        raise DigestMismatchError(f"{where} decoded to other bytes than the source's")
