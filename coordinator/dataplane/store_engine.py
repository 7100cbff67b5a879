"""Store: cut a checkpoint into shard blobs and send each to its nodes.

The engine is plain Python (no Celery): `prepare_store` plans and hashes,
`send_shard` moves one (shard, replica), `store_checkpoint` runs the whole
thing for scripts, tests and benchmarks. The Celery tasks call the same
pieces one transfer at a time.

Tensor bytes never become Python objects beyond one fixed read buffer per
hashing thread: hashing reads with readinto, sending is os.sendfile.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from coordinator.dataplane.chunk_source import sendable
from coordinator.dataplane.digest_cache import DigestCache
from coordinator.dataplane.node_client import NodeAddress, NodeClient, NodeStat
from coordinator.plan.blob_spans import BlobSpan, blob_spans
from coordinator.plan.manifest import Manifest
from coordinator.plan.manifest_entries import shard_entries
from coordinator.plan.placement import place
from coordinator.plan.planner import ShardPlan, plan_shards
from coordinator.plan.safetensors_header import CheckpointHeader, read_header
from coordinator.plan.source_file import SourceIdentity
from coordinator.plan.version_ids import version_id_for
from smoltorrent import defaults
from smoltorrent.errors import (
    BadTargetError,
    DigestMismatchError,
    NodeError,
    NodeUnavailableError,
    ProtocolError,
    SmoltorrentError,
    SourceChangedError,
)

Progress = Callable[[int], None]


@dataclass(frozen=True)
class PreparedStore:
    """A planned, hashed and placed version, before any byte is sent."""

    path: str
    manifest: Manifest
    prefixes: tuple[bytes, ...]  # each shard blob's own safetensors header
    targets: tuple[tuple[str, ...], ...]  # per shard, the node ids chosen for it
    identity: SourceIdentity
    hashed_bytes: int = 0  # source bytes read to hash at plan time (0: digests were cached)

    @property
    def vkey(self) -> str:
        return self.manifest.storage_key()

    def spans(self) -> tuple[BlobSpan, ...]:
        return blob_spans(self.manifest, self.prefixes)

    @property
    def tensor_count(self) -> int:
        return self.manifest.tensor_count()  # a shard manifest names its tensors


@dataclass
class StoreResult:
    manifest: Manifest
    holders: dict[int, list[str]] = field(default_factory=dict)  # shard -> node ids
    errors: list[str] = field(default_factory=list)
    bytes_sent: int = 0  # blob bytes that moved, from the source or node to node
    bytes_from_source: int = 0  # of those, the ones the coordinator's own link carried

    def under_replicated(self) -> list[int]:
        return [i for i, nodes in self.holders.items() if len(nodes) < self.manifest.replicas]


def hash_shard(path: str, header: CheckpointHeader, plan: ShardPlan) -> tuple[str, tuple[str, ...]]:
    """The blob's SHA-256 and each of its tensors' (manifest schema 2), in one read."""
    by_name = {tensor.name: tensor for tensor in header.tensors}
    ends = [by_name[name].end - plan.data_start for name in plan.tensors]
    return _hash_pass(
        path, plan.index, plan.prefix, header.data_start + plan.data_start, plan.data_size, ends
    )


def hash_blob(path: str, index: int, prefix: bytes, offset: int, length: int) -> str:
    """SHA-256 of a blob as it would be sent now: prefix, then length bytes of path at offset."""
    return _hash_pass(path, index, prefix, offset, length, ())[0]


def mismatch_cause(
    identity: SourceIdentity,
    path: str,
    span: BlobSpan,
    address: object,
    exc: Exception,
) -> SourceChangedError | BadTargetError:
    """Whose fault a node's digest mismatch is: the source's if its bytes changed since the
    plan (the version is abandoned), else the node's (it corrupted what it was sent:
    another node takes the replica)."""
    shard_index = span.index
    identity.check(path)
    if hash_blob(path, shard_index, span.prefix, span.offset, span.length) != span.digest:
        cause: SourceChangedError | BadTargetError = SourceChangedError(
            f"{path} changed while shard {shard_index} was sent (the node hashed different"
            " bytes); the partial version was abandoned."
        )
    else:
        cause = BadTargetError(
            f"node {address} stored other bytes than the unchanged source sent for shard"
            f" {shard_index} ({exc}): its disk, memory or network link corrupts data. Check"
            " that node (`smoltorrent status`), or remove it from the cluster."
        )
    return cause


def _hash_pass(
    path: str,
    index: int,
    prefix: bytes,
    offset: int,
    length: int,
    tensor_ends: Sequence[int],
) -> tuple[str, tuple[str, ...]]:
    """SHA-256 of a blob as it would be sent now: prefix, then length bytes of path at
    offset; and, in the same pass, of each run of those bytes ending at `tensor_ends`
    (relative to offset, ascending: one per tensor, in data order)."""
    hasher = hashlib.sha256(prefix)
    pieces = [hashlib.sha256() for _ in tensor_ends]
    piece = 0  # the tensor the next byte belongs to
    buf = bytearray(defaults.IO_CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        done = 0
        while done < length:
            n = f.readinto(view[: min(length - done, len(buf))])
            if not n:
                raise SourceChangedError(
                    f"{path} ended early while hashing shard {index}; it is being "
                    "rewritten. Store it again once training has finished writing it."
                )
            chunk = view[:n]
            hasher.update(chunk)
            at = 0
            while at < n and piece < len(pieces):
                # Zero-size tensors end where they start: their digest is of no bytes.
                cut = min(n, tensor_ends[piece] - done)
                pieces[piece].update(chunk[at:cut])
                at = cut
                if done + at == tensor_ends[piece]:
                    piece += 1
            done += n
    return hasher.hexdigest(), tuple(p.hexdigest() for p in pieces)


def prepare_store(
    path: str | os.PathLike,
    name: str,
    free_bytes: Mapping[str, int],
    *,
    replicas: int = defaults.DEFAULT_REPLICAS,
    shards: int | None = None,
    place_replicas: int | None = None,
    threads: int = defaults.HASH_THREADS,
    digest_cache: DigestCache | None = None,
) -> PreparedStore:
    """Parse the header, plan shards, hash every blob (or take the digests the cache
    holds for this very file), place replicas.

    `place_replicas` below `replicas` stores under-replicated on purpose (fewer
    live nodes than R): the manifest keeps the wanted R, so the gap shows.
    """
    path = os.fspath(path)
    identity = SourceIdentity.of(path)
    header = read_header(path)
    identity.check(path)
    plans = plan_shards(header, shards or max(1, len(free_bytes)))
    key = DigestCache.key(os.stat(path), plans) if digest_cache else ""
    hashed = digest_cache.get(key) if digest_cache else None
    hashed_bytes = 0
    if hashed is None or len(hashed) != len(plans):
        with ThreadPoolExecutor(max_workers=threads) as pool:
            hashed = list(pool.map(lambda p: hash_shard(path, header, p), plans))
        hashed_bytes = sum(p.data_size for p in plans)
        # Remembered only if the file is still the one whose stat made the key.
        if digest_cache and DigestCache.key(os.stat(path), plans) == key:
            digest_cache.put(key, hashed)
    identity.check(path)
    digests = [blob for blob, _ in hashed]
    targets = (
        place([p.blob_size for p in plans], free_bytes, place_replicas or replicas) if plans else []
    )
    manifest = Manifest(
        name=name,
        version_id=version_id_for(header.header_bytes, digests),
        source_size=header.file_size,
        header_bytes=header.header_bytes,
        replicas=replicas,
        shards=shard_entries(plans, digests, [tensors for _, tensors in hashed]),
        created_at=time.time(),
    )
    return PreparedStore(
        path=path,
        manifest=manifest,
        prefixes=tuple(p.prefix for p in plans),
        targets=tuple(tuple(t) for t in targets),
        identity=identity,
        hashed_bytes=hashed_bytes,
    )


def send_shard(
    prepared_path: str,
    identity: SourceIdentity,
    span: BlobSpan,
    target: NodeClient,
    holders: Sequence[NodeClient] = (),
    progress: Progress | None = None,
    spool: str | os.PathLike = "",
) -> str:
    """Make `target` hold the shard (or chunk) of `span`; returns how: exists, replicated
    or sent. An encoded chunk is sent from its spooled file, encoded again into `spool`
    when that is gone (coordinator/dataplane/chunk_source.py).
    progress(n) follows a send from the source: n bytes of the shard's range sent so far.

    A node that already holds a verified copy pushes it node to node first
    (the coordinator's own link is usually the bottleneck); the source file
    is the fallback, checked against its plan-time identity before sending.
    A holder whose copy turns out corrupt (the target refuses what it pushed)
    is skipped like a down one: the source can still send the shard.

    When the target hashes other bytes than the source sent, the source is
    hashed again: only a changed source raises SourceChangedError (abandon the
    version). An unchanged one means the target corrupted the bytes:
    BadTargetError, a NodeError: the caller moves the replica to another node, or
    retries and finally dead-letters when none can take it; never a reason to
    abandon and re-store.
    """
    for holder in holders:
        try:
            return "replicated" if holder.replicate(span.digest, target.address) else "exists"
        except (NodeUnavailableError, NodeError, ProtocolError, DigestMismatchError):
            continue
    prepared_path, identity, span = sendable(prepared_path, identity, span, spool)
    identity.check(prepared_path)
    with open(prepared_path, "rb") as f:
        try:
            stored = target.put_blob(
                span.digest, span.prefix, f.fileno(), span.offset, span.length, progress
            )
        except DigestMismatchError as exc:
            cause = mismatch_cause(identity, prepared_path, span, target.address, exc)
            raise cause from exc
    return "sent" if stored else "exists"


def probe_nodes(
    nodes: Mapping[str, NodeAddress], cluster_key: bytes | None = None
) -> dict[str, NodeStat]:
    """Stat every node in parallel; the ones that answer are live."""

    def one(item: tuple[str, NodeAddress]) -> tuple[str, NodeStat | None]:
        node_id, address = item
        try:
            return node_id, NodeClient(
                address, cluster_key=cluster_key, timeout=defaults.CONNECT_TIMEOUT_S
            ).stat()
        except (NodeUnavailableError, NodeError, ProtocolError):
            return node_id, None

    if not nodes:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(nodes))) as pool:
        return {nid: st for nid, st in pool.map(one, nodes.items()) if st is not None}


def store_checkpoint(
    path: str | os.PathLike,
    addresses: Sequence[NodeAddress],
    *,
    name: str | None = None,
    replicas: int = defaults.DEFAULT_REPLICAS,
    shards: int | None = None,
    cluster_key: bytes | None = None,
    chain: bool = False,
    threads: int = defaults.TRANSFER_THREADS,
    progress: Progress | None = None,
) -> StoreResult:
    """Store a checkpoint on the given nodes without Celery; returns what landed where.

    By default every (shard, replica) is sent from the source at once, as the
    Celery path does. With `chain`, a shard goes to its first node and from
    there node to node: the coordinator's own link then carries every byte
    once, which wins when that link, not the nodes, is the bottleneck. The
    manifest is written to every node that holds a blob of this version.
    """
    path = os.fspath(path)
    by_address = {str(a): a for a in addresses}
    stats = probe_nodes(by_address, cluster_key)
    ids = {stat.node_id: by_address[addr] for addr, stat in stats.items()}
    prepared = prepare_store(
        path,
        name or os.path.basename(path),
        {stat.node_id: stat.free_bytes for stat in stats.values()},
        replicas=replicas,
        shards=shards or len(ids),
    )
    manifest = prepared.manifest
    result = StoreResult(manifest=manifest, holders={i: [] for i in range(len(manifest.shards))})
    lock = threading.Lock()

    def client(node_id: str) -> NodeClient:
        return NodeClient(ids[node_id], cluster_key=cluster_key)

    targets = _prefer_holders(prepared, {n: client(n) for n in ids})
    spans = prepared.spans()

    def send(index: int, node_id: str, holders: Sequence[str]) -> bool:
        try:
            how = send_shard(
                path,
                prepared.identity,
                spans[index],
                client(node_id),
                [client(h) for h in holders],
            )
        except (NodeUnavailableError, NodeError, ProtocolError) as exc:
            with lock:
                result.errors.append(f"shard {index} -> node {node_id}: {exc}")
            return False
        size = manifest.shards[index].blob_size
        with lock:
            result.holders[index].append(node_id)
            result.bytes_sent += 0 if how == "exists" else size
            result.bytes_from_source += size if how == "sent" else 0
        if progress:
            progress(size)
        return True

    def chained(index: int) -> None:
        for node_id in targets[index]:
            send(index, node_id, list(result.holders[index]))

    with ThreadPoolExecutor(max_workers=threads) as pool:
        if chain:
            list(pool.map(chained, range(len(manifest.shards))))
        else:
            jobs = [(i, n) for i, nodes in enumerate(targets) for n in nodes]
            list(pool.map(lambda job: send(job[0], job[1], ()), jobs))

    missing = [i for i, h in result.holders.items() if not h]
    if missing:
        raise SmoltorrentError(
            f"{path}: shard(s) {missing} reached no node ({'; '.join(result.errors)}). "
            "Nothing was committed; check the nodes with `smoltorrent status` and store again."
        )
    write_manifest(manifest, [client(n) for n in {n for h in result.holders.values() for n in h}])
    return result


def _prefer_holders(
    prepared: PreparedStore, clients: Mapping[str, NodeClient]
) -> list[tuple[str, ...]]:
    """Keep each shard on nodes that already hold its blob: unchanged content moves no bytes,
    even when free space (and so the fresh placement) shifted since it was stored."""
    digests = [s.blob_sha256 for s in prepared.manifest.shards]

    def held(node_id: str) -> set[str]:
        try:
            return clients[node_id].has(digests)
        except (NodeUnavailableError, NodeError, ProtocolError):
            return set()

    if not digests or not clients:
        return [tuple(t) for t in prepared.targets]
    with ThreadPoolExecutor(max_workers=min(32, len(clients))) as pool:
        holding = dict(zip(clients, pool.map(held, clients), strict=True))
    out = []
    for planned, digest in zip(prepared.targets, digests, strict=True):
        holders = sorted(n for n, blobs in holding.items() if digest in blobs)[: len(planned)]
        rest = [n for n in planned if n not in holders]
        out.append(tuple(holders + rest[: len(planned) - len(holders)]))
    return out


def write_manifest(manifest: Manifest, clients: Sequence[NodeClient]) -> int:
    """Put the manifest on every given node; returns how many took it (at least one)."""
    key = manifest.storage_key()
    data = manifest.to_json()
    errors: list[str] = []
    written = 0
    for c in clients:
        try:
            c.put_manifest(key, data)
            written += 1
        except (NodeUnavailableError, NodeError) as exc:
            errors.append(str(exc))
    if clients and not written:
        raise SmoltorrentError(
            f"the manifest of {manifest.name} could not be written to any node "
            f"({'; '.join(errors)}); the version stays uncommitted. Retry when a node is back."
        )
    return written
