"""Rebuild the Redis metadata from what the nodes hold.

Every committed manifest lives on the nodes that hold its blobs, and every
node can list its blobs, so losing Redis loses no checkpoint: nodes,
versions, current versions and placement all come back from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.plan.manifest import Manifest
from coordinator.state.metadata import Metadata
from smoltorrent.errors import NodeError, NodeUnavailableError, SmoltorrentError


def rebuild_metadata(
    md: Metadata, addresses: Sequence[NodeAddress], cluster_key: bytes | None
) -> dict:
    manifests: dict[str, Manifest] = {}
    unreachable: list[str] = []
    placements = 0
    nodes_read = 0
    for address in addresses:
        client = NodeClient(address, cluster_key=cluster_key)
        try:
            stat = client.stat()
            blobs = client.list_blobs()
            for key in client.list_manifests():
                if key not in manifests:
                    manifests[key] = Manifest.from_json(client.get_manifest(key))
        except (NodeUnavailableError, NodeError, SmoltorrentError) as exc:
            unreachable.append(f"{address}: {exc}")
            continue
        nodes_read += 1
        md.add_node(stat.node_id, address)
        md.mark_alive(stat.node_id, dataclasses.asdict(stat))
        for digest in blobs:
            md.add_placement(digest, stat.node_id)
            placements += 1
    restored = 0
    for key, manifest in sorted(manifests.items(), key=lambda kv: kv[1].created_at):
        vkey = manifest.storage_key()
        if vkey != key:
            unreachable.append(f"manifest {key} names another version ({vkey}); skipped")
            continue
        restored += md.restore_committed(manifest, vkey)
    return {
        "nodes_read": nodes_read,
        "versions": len(manifests),
        "restored": restored,
        "names": len({m.name for m in manifests.values()}),
        "placements": placements,
        "unreachable": unreachable,
    }
