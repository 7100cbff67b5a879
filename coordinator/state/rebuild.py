"""Rebuild the Redis metadata from what the nodes hold.

Every committed manifest lives on the nodes that hold its blobs, and every
node can list its blobs, so losing Redis loses no checkpoint: nodes,
versions, current versions and placement all come back from here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence

from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.plan.directory import RECORD_FILE, record_of
from coordinator.plan.manifest import Manifest
from coordinator.plan.safetensors_header import CheckpointHeader, parse_header
from coordinator.plan.version_ids import storage_key
from coordinator.state import redis_keys as K
from coordinator.state.directories import Directories, DirectoryVersion, Member
from coordinator.state.metadata import Metadata
from coordinator.state.steps import (
    RANK_KEY,
    STEP_KEY,
    STEP_NAME_KEY,
    WORLD_SIZE_KEY,
    Part,
    Steps,
)
from coordinator.state.versions import COMMITTED
from smoltorrent import defaults
from smoltorrent.errors import NodeError, NodeUnavailableError, SmoltorrentError


def rebuild_metadata(
    md: Metadata, addresses: Sequence[NodeAddress], cluster_key: bytes | None
) -> dict:
    manifests: dict[str, Manifest] = {}
    marked: dict[str, Manifest] = {}  # per version, the copy whose marks were set last
    copies: dict[str, set[bytes]] = {}  # per version, the SHA-256 of each copy parsed
    unreachable: list[str] = []
    skipped: list[str] = []
    held: set[str] = set()
    listed: dict[str, list[str]] = {}  # node id -> the manifest keys it holds
    placements = 0
    nodes_read = 0
    for address in addresses:
        client = NodeClient(address, cluster_key=cluster_key)
        try:
            stat = client.stat()
            blobs = client.list_blobs()
            keys = client.list_manifests()
        except (NodeUnavailableError, NodeError, SmoltorrentError) as exc:
            unreachable.append(f"{address}: {exc}")
            continue
        # Versions removed while this node was dead: its copies are owed, never restored.
        owed = md.nodes.manifests_owed(stat.node_id)
        skipped += [
            f"manifest {k} on {address}: removed while the node was dead" for k in keys if k in owed
        ]
        keys = [k for k in keys if k not in owed]
        # One unreadable manifest costs only itself, never the node's whole inventory.
        # Every copy is read: the one with the highest request number (a rollback's,
        # tasks/commit.py record_request_order) says where the version stands.
        for key, raw in client.get_manifests(keys):
            try:
                if isinstance(raw, SmoltorrentError):
                    raise raw
                # A copy byte for byte like one read already says nothing new: parsed once
                # (the nodes holding a version's blobs keep the same copy, each a parse).
                alike = hashlib.sha256(raw).digest()
                if alike in copies.setdefault(key, set()):
                    continue
                manifest = Manifest.from_json(raw)
                copies[key].add(alike)
            except (NodeUnavailableError, NodeError, SmoltorrentError) as exc:
                skipped.append(f"manifest {key} on {address}: {exc}")
                continue
            if manifest.version_id != manifest.content_version_id():  # forged, or damaged
                skipped.append(
                    f"manifest {key} on {address}: version id {manifest.version_id[:12]} is"
                    " not its content's"
                )
                continue
            if key not in manifests or manifest.seq > manifests[key].seq:
                manifests[key] = manifest
            if manifest.marks_seq > getattr(marked.get(key), "marks_seq", 0):
                marked[key] = manifest
        nodes_read += 1
        listed[stat.node_id] = keys
        md.nodes.add_node(stat.node_id, address)
        md.nodes.mark_alive(stat.node_id, dataclasses.asdict(stat))
        md.blobs.add_placements(blobs, stat.node_id)
        held.update(blobs)
        placements += len(blobs)
    # Numbers taken from here on come after every one the nodes' copies carry: a pin or
    # label changed after this rebuild must outrank a copy a node kept from before it.
    top = max((max(m.seq, m.marks_seq) for m in [*manifests.values(), *marked.values()]), default=0)
    behind = top - int(md.r.get(K.SEQ) or 0)
    if behind > 0:
        md.r.incrby(K.SEQ, behind)
    restored = 0
    brought_back: set[str] = set()
    found: set[str] = set()  # the versions not skipped: restored, or known to Redis already
    headers = _Headers()
    batch: list[tuple[Manifest, str, int]] = []

    def record(batch: list[tuple[Manifest, str, int]]) -> None:
        nonlocal restored
        done = md.versions.restore_committed_many(batch)
        for (_, vkey, _), brought in zip(batch, done, strict=True):
            if brought:
                restored += 1
                brought_back.add(vkey)
        # So a store finds them stored again.
        md.chunks.record(chunk for manifest, _, _ in batch for chunk in manifest.chunks)
        batch.clear()

    # In request order (each restored version takes a new number in turn, so the last
    # request of a name is current again); manifests that record none, by creation.
    for key, manifest in sorted(manifests.items(), key=lambda kv: (kv[1].seq, kv[1].created_at)):
        vkey = manifest.storage_key()
        if vkey != key:
            skipped.append(f"manifest {key} names another version ({vkey})")
            continue
        missing = [i for i, s in enumerate(manifest.entries) if s.blob_sha256 not in held]
        if missing:
            # Committed means gatherable: a version with a shard on no node is not.
            skipped.append(
                f"{manifest.name} {manifest.version_id[:12]}: shards {missing} on no node"
            )
            continue
        if key in marked:  # its R as last set (set_replicas), like its pin and labels
            manifest = dataclasses.replace(manifest, replicas=marked[key].replicas)
        found.add(key)
        # Recorded REBUILD_BATCH_VERSIONS at a time, still oldest first.
        batch.append((manifest, vkey, headers.tensor_count(manifest)))
        if len(batch) >= defaults.REBUILD_BATCH_VERSIONS:
            record(batch)
    if batch:
        record(batch)
    # Where each copy is: a remove of the version deletes it there, so a later rebuild
    # cannot bring the version back from a node outside its blobs' placement.
    for node_id, keys in listed.items():
        md.versions.note_manifests_held(node_id, [k for k in keys if k in found])
    marks = restore_marks(md, [m for k, m in marked.items() if k in brought_back])
    steps = restore_steps(md, list(manifests.values()), headers)
    directories = restore_directories(md, list(manifests.values()))
    return {
        "nodes_read": nodes_read,
        "versions": len(found),
        "restored": restored,
        "names": len({manifests[k].name for k in found}),
        # Manifests not restored (a shard on no node, a copy naming another version) or
        # not read: each is said in "unreachable" too.
        "skipped": len(skipped),
        "placements": placements,
        "steps": steps,
        "directories": directories,
        "marks": marks,
        "unreachable": unreachable + skipped,
    }


def restore_marks(md: Metadata, marked: Sequence[Manifest]) -> int:
    """Pins and labels of the versions restored, from the copy of each whose marks were
    set last (coordinator/state/marks.py), applied in that order: a label two versions of
    a name claim (a node was down when it moved) ends on the later. How many versions had
    any."""
    applied = 0
    for manifest in sorted(marked, key=lambda m: m.marks_seq):
        vkey = manifest.storage_key()
        if manifest.pinned:
            md.versions.pin(vkey)
        for label in manifest.labels:
            md.versions.tag(vkey, manifest.name, label)
        md.r.hset(K.VERSION.format(vkey=vkey), "marks_seq", manifest.marks_seq)
        applied += bool(manifest.pinned or manifest.labels)
    return applied


def _header(manifest: Manifest) -> CheckpointHeader:
    length = struct.pack("<Q", len(manifest.header_bytes))
    return parse_header(length, manifest.header_bytes, manifest.source_size)


class _Headers:
    """Each distinct source header parsed once for the whole rebuild: a name's versions
    mostly keep one layout (a fine-tune changes values, not tensors), and parsing it again
    for every version's tensor count and again for its step was a fifth of a rebuild's
    time. A header that does not parse is not kept: each use raises as it did."""

    def __init__(self) -> None:
        self._parsed: dict[tuple[bytes, int], CheckpointHeader] = {}

    def of(self, manifest: Manifest) -> CheckpointHeader:
        """_header(manifest)."""
        key = (manifest.header_bytes, manifest.source_size)
        if key not in self._parsed:
            self._parsed[key] = _header(manifest)
        return self._parsed[key]

    def tensor_count(self, manifest: Manifest) -> int:
        """manifest.tensor_count()."""
        if not manifest.chunked:
            return manifest.tensor_count()
        key = (manifest.header_bytes, manifest.source_size)
        if key not in self._parsed:
            self._parsed[key] = manifest.header()  # raising as tensor_count does
        return len(self._parsed[key].tensors)


def restore_directories(md: Metadata, manifests: Sequence[Manifest]) -> int:
    """Directory checkpoints whose record (NAME/.directory.safetensors, its current
    version) and every file version it names are committed again; made current."""
    directories = Directories(md.r)
    restored = 0
    for manifest in manifests:
        if not manifest.name.endswith("/" + RECORD_FILE) or manifest.entries:
            continue
        vkey = manifest.storage_key()
        if md.versions.current(manifest.name) != vkey:
            continue  # an older record: only the current one is the directory
        try:
            record = record_of(_header(manifest))
        except SmoltorrentError:
            continue
        if record is None or directories.is_directory(record.name):
            continue
        members = {}
        for file, version_id in record.files.items():
            name = f"{record.name}/{file}"
            member = storage_key(name, version_id)
            if md.versions.state(member) != COMMITTED:
                break
            size = int(md.versions.version(member)["size"])
            members[file] = Member(name, member, version_id, size)
        else:
            # The record's own sequence number: later than its files', as its store was.
            directories.commit(
                DirectoryVersion(
                    name=record.name,
                    version_id=manifest.version_id,
                    files=members,
                    index_name=record.index_name,
                    index=record.index_bytes,
                    created_at=manifest.created_at,
                ),
                int(md.versions.version(vkey).get("seq") or 0),
            )
            restored += 1
    return restored


def restore_steps(
    md: Metadata, manifests: Sequence[Manifest], headers: _Headers | None = None
) -> int:
    """Steps of sharded checkpoints whose every rank's part is a committed version again:
    each part says in its own header which step, rank and world size it belongs to."""
    headers = headers or _Headers()
    found: dict[tuple[str, int, int], dict[int, Part]] = {}
    for manifest in manifests:
        try:
            meta = headers.of(manifest).metadata or {}
            key = (meta[STEP_NAME_KEY], int(meta[STEP_KEY]), int(meta[WORLD_SIZE_KEY]))
            rank = int(meta[RANK_KEY])
        except (KeyError, ValueError, SmoltorrentError):
            continue  # not a part of a sharded checkpoint
        vkey = manifest.storage_key()
        # The part's current version: a rank may have stored its part more than once.
        if md.versions.current(manifest.name) != vkey or md.versions.state(vkey) != COMMITTED:
            continue
        part = Part(rank, manifest.name, vkey, manifest.version_id, manifest.source_size)
        found.setdefault(key, {})[rank] = part
    steps = Steps(md.r)
    restored = 0
    for (name, step, world_size), parts in sorted(found.items()):
        if set(parts) == set(range(world_size)):
            restored += steps.restore(name, step, world_size, list(parts.values()))
    return restored
