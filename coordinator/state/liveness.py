"""Which registered nodes are up, down or dead, recorded in Redis.

up: answered a probe within NODE_ALIVE_TTL_S (a TTL key the health sweep keeps
fresh, so a store places shards without another round trip). down: missed its
latest probe but silent for less than the dead timeout; its copies still count,
since a reboot or a network blip should not set off a node's worth of copying.
dead: silent for the dead timeout or longer; its copies no longer count and its
shards are copied elsewhere. A dead node that answers again is up at once
(re-admitted). The time each node last answered is kept, so `status` can say
when a dead node was last seen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from coordinator.dataplane.node_client import NodeStat
from coordinator.dataplane.store_engine import probe_nodes
from coordinator.state.clock import redis_clock
from coordinator.state.metadata import Metadata

UP, DOWN, DEAD = "up", "down", "dead"


@dataclass(frozen=True)
class NodeHealth:
    node_id: str
    state: str  # UP, DOWN or DEAD
    last_seen: float | None  # unix time of its last answer; None if it never answered


def probe_registered(
    md: Metadata, cluster_key: bytes | None, *, trust_recent: bool = False
) -> dict[str, NodeStat]:
    """Node id -> stat of the live registered nodes. Probes every node (or, with
    trust_recent, only those not heard from lately) and refreshes the alive keys."""
    nodes = md.nodes.nodes()
    recent = md.nodes.alive(nodes) if trust_recent else {}
    live = {n: NodeStat(**stat) for n, stat in recent.items()}
    to_probe = {nid: rec.address for nid, rec in nodes.items() if nid not in live}
    stats = probe_nodes(to_probe, cluster_key)
    now = redis_clock(md.r) if stats else None  # when they answered, one read for all
    for node_id in to_probe:
        stat = stats.get(node_id)
        # A node answering with another id is a different data dir at the old address.
        if stat is None or stat.node_id != node_id:
            md.nodes.mark_down(node_id)
            continue
        md.nodes.mark_alive(node_id, dataclasses.asdict(stat), now)
        live[node_id] = stat
    return live


def node_health(
    md: Metadata, dead_after: float, up: set[str] | None = None, *, now: float | None = None
) -> dict[str, NodeHealth]:
    """Every registered node's health at `now` (default: now on the Redis clock, which
    every last-seen time is written on: a host whose clock is minutes off neither keeps a
    dead node's copies counted nor declares a live node dead). `up` is the set that
    answered a probe just now (default: the nodes whose alive key is fresh). A node that
    never answered counts its silence from when it was registered."""
    now = redis_clock(md.r) if now is None else now
    nodes = md.nodes.nodes()
    if up is None:
        up = set(md.nodes.alive(nodes))
    seen = md.nodes.last_seen()
    out = {}
    for node_id, rec in nodes.items():
        last = seen.get(node_id)
        if node_id in up:
            state = UP
        elif now - (last if last is not None else rec.added_at) >= dead_after:
            state = DEAD
        else:
            state = DOWN
        out[node_id] = NodeHealth(node_id, state, last)
    return out
