"""Which registered nodes are up, recorded as TTL keys in Redis.

A node that answered within NODE_ALIVE_TTL_S counts as up without another
round trip (the health sweep keeps those keys fresh); a node that died
inside that window is found out by its transfers, which retry and then
dead-letter, and its shards show as under-replicated.
"""

from __future__ import annotations

import dataclasses

from coordinator.dataplane.node_client import NodeStat
from coordinator.dataplane.store_engine import probe_nodes
from coordinator.state.metadata import Metadata


def probe_registered(
    md: Metadata, cluster_key: bytes | None, *, trust_recent: bool = False
) -> dict[str, NodeStat]:
    """Node id -> stat of the live registered nodes. Probes every node (or, with
    trust_recent, only those not heard from lately) and refreshes the alive keys."""
    nodes = md.nodes()
    recent = md.alive(nodes) if trust_recent else {}
    live = {n: NodeStat(**stat) for n, stat in recent.items()}
    to_probe = {nid: rec.address for nid, rec in nodes.items() if nid not in live}
    stats = probe_nodes(to_probe, cluster_key)
    for node_id in to_probe:
        stat = stats.get(node_id)
        # A node answering with another id is a different data dir at the old address.
        if stat is None or stat.node_id != node_id:
            md.mark_down(node_id)
            continue
        md.mark_alive(node_id, dataclasses.asdict(stat))
        live[node_id] = stat
    return live
