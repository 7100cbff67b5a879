"""Which registered nodes are up right now, recorded as TTL keys in Redis."""

from __future__ import annotations

import dataclasses

from coordinator.metadata import Metadata
from coordinator.node_client import NodeStat
from coordinator.store_engine import probe_nodes


def probe_registered(md: Metadata, cluster_key: bytes | None) -> dict[str, NodeStat]:
    """Stat every registered node in parallel; refresh the alive keys of those that answer
    and drop those of the rest. Returns node id -> stat of the live ones."""
    nodes = md.nodes()
    stats = probe_nodes({nid: rec.address for nid, rec in nodes.items()}, cluster_key)
    live: dict[str, NodeStat] = {}
    for node_id in nodes:
        stat = stats.get(node_id)
        # A node answering with another id is a different data dir at the old address.
        if stat is None or stat.node_id != node_id:
            md.mark_down(node_id)
            continue
        md.mark_alive(node_id, dataclasses.asdict(stat))
        live[node_id] = stat
    return live
