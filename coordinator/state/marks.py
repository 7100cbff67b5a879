"""Pins and labels kept on the nodes too, so a rebuild from the nodes brings them back.
A version's R is one of its marks as well: `store --replicas` on stored content changes it
(Versions.set_replicas), with a marks_seq of its own.

Redis holds them (`PINS`, `TAGS`, coordinator/state/versions.py); the nodes' copies of a
version's manifest carry them as well, with `marks_seq`, a number from the one counter
taken at each change. Every change puts the version's manifest again on the live nodes
holding its blobs; a copy on a node that was down then keeps older marks, so of the
copies a rebuild reads, the one with the highest `marks_seq` says the version's marks
(coordinator/state/rebuild.py), and a label two versions claim goes to the later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from coordinator.dataplane.node_client import NodeClient
from coordinator.dataplane.store_engine import write_manifest
from coordinator.plan.manifest import Manifest
from coordinator.state import redis_keys as K
from coordinator.state.liveness import probe_registered
from coordinator.state.metadata import Metadata
from smoltorrent.errors import SmoltorrentError


def node_manifest(md: Metadata, vkey: str, manifest: Manifest | None = None) -> Manifest:
    """Version `vkey`'s manifest as the nodes keep it: with its request order and marks.
    `manifest`: its manifest when the caller has read it already (read here otherwise)."""
    v = md.versions.version(vkey)
    pinned, labels = md.versions.labels([vkey])[vkey]
    return dataclasses.replace(
        md.versions.manifest(vkey) if manifest is None else manifest,
        seq=int(v.get("seq") or 0),
        marks_seq=int(v.get("marks_seq") or 0),
        pinned=pinned,
        labels=tuple(labels),
    )


def publish(md: Metadata, vkeys: Iterable[str], cluster_key: bytes | None) -> int:
    """The pins or labels of `vkeys` just changed in Redis: each takes a fresh marks_seq,
    and its manifest goes again to the nodes that answer and hold its blobs. How many
    copies were written (0: none answered; Redis keeps the change, and the next one or a
    rollback writes them)."""
    vkeys = list(dict.fromkeys(vkeys))
    for vkey in vkeys:
        md.r.hset(K.VERSION.format(vkey=vkey), "marks_seq", md.requests.next_seq())
    registered = md.nodes.nodes()
    live = set(probe_registered(md, cluster_key, trust_recent=True))
    written = 0
    for vkey in vkeys:
        manifest = node_manifest(md, vkey)
        placed = set().union(*(md.blobs.placement(d) for d, _ in manifest.blobs))
        to = [n for n in sorted(placed & live) if n in registered]
        md.versions.note_manifest_nodes(vkey, to)  # before the copies: a remove finds them
        holders = [NodeClient(registered[n].address, cluster_key=cluster_key) for n in to]
        try:
            written += write_manifest(manifest, holders)
        except SmoltorrentError:
            continue  # none took it: Redis keeps the change
    return written
