"""Nodes and workers: each storage node's record, whether it answered lately, when it was
last seen, whether the health sweep declared it dead; and which hosts' workers run (the
boot id of each)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from coordinator.dataplane.node_client import NodeAddress, NodeStat
from coordinator.state import redis_keys as K
from coordinator.state.clock import redis_clock
from smoltorrent import defaults
from smoltorrent.errors import UsageError


def unreachable_keys(node_ids: list[str]) -> list[str]:
    """The marks mark_unreachable sets, to read with MGET (alone, or in a caller's
    pipeline beside its other reads: trim_marks.placement_marked)."""
    return [K.NODE_UNREACHABLE.format(node_id=n) for n in node_ids]


def marked_unreachable(node_ids: list[str], marks: list) -> set[str]:
    """Those of `node_ids` whose mark (unreachable_keys, in the same order) is set."""
    return {n for n, mark in zip(node_ids, marks, strict=True) if mark}


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    address: NodeAddress
    added_at: float
    # A node on loopback: its data directory and the host it runs on, so `smoltorrent up`
    # there starts it again (same id, same address) instead of a new node at its address.
    data_dir: str | None = None
    host: str | None = None


class Nodes:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def add_node(
        self, node_id: str, address: NodeAddress, local: tuple[str, str] | None = None
    ) -> None:
        """Register (or move) a node by id. `local`: (its data directory, this host's id) for
        a node on this host's loopback, which `smoltorrent up` may start again."""
        record = {"address": str(address), "added_at": redis_clock(self.r)}
        if local is not None:
            record |= {"data_dir": local[0], "host": local[1]}
        self.r.hset(K.NODES, node_id, json.dumps(record))

    def refuse_second_id(self, address: NodeAddress, node_id: str) -> None:
        """UsageError when `address` is registered to another node already: a second id
        there would leave the first "down" for ever, and its copies counted lost."""
        others = sorted(
            n for n, rec in self.nodes().items() if rec.address == address and n != node_id
        )
        if others:
            old = others[0][:12]
            raise UsageError(
                f"{address} is registered to node {old} already, and node {node_id[:12]}"
                f" answers there now: one address takes one node. If {old}'s data is gone,"
                f" run `smoltorrent nodes rm {old}` first (its copies are repaired from the"
                " others); if it moved, start it and add it at its new address first"
            )

    def remove_node(self, node_id: str) -> bool:
        with self.r.pipeline() as p:
            p.delete(K.NODE_ALIVE.format(node_id=node_id))
            p.hdel(K.NODE_SEEN, node_id)
            p.hdel(K.NODE_SCRUB, node_id)
            p.srem(K.NODES_DEAD, node_id)
            p.delete(K.MANIFESTS_OWED.format(node_id=node_id))
            p.hdel(K.NODES, node_id)
            *_, removed = p.execute()
        return bool(removed)

    def nodes(self) -> dict[str, NodeRecord]:
        out = {}
        for node_id, raw in self.r.hgetall(K.NODES).items():
            data = json.loads(raw)
            out[node_id] = NodeRecord(
                node_id,
                NodeAddress.parse(data["address"]),
                data["added_at"],
                data.get("data_dir"),
                data.get("host"),
            )
        return out

    # --- liveness ------------------------------------------------------------------

    def mark_alive(self, node_id: str, stat: dict, now: float | None = None) -> None:
        """The node answered just now: up for NODE_ALIVE_TTL_S, and last seen now (on the
        Redis clock, as node_health reads it; a probe of every node reads it once)."""
        now = redis_clock(self.r) if now is None else now
        with self.r.pipeline() as p:
            p.set(
                K.NODE_ALIVE.format(node_id=node_id),
                json.dumps(stat),
                ex=defaults.NODE_ALIVE_TTL_S,
            )
            p.hset(K.NODE_SEEN, node_id, repr(now))
            p.delete(K.NODE_UNREACHABLE.format(node_id=node_id))
            p.execute()

    def mark_down(self, node_id: str) -> None:
        self.r.delete(K.NODE_ALIVE.format(node_id=node_id))

    def mark_unreachable(self, node_ids: Iterable[str]) -> None:
        """A transfer could not reach these nodes: the next ones place elsewhere for
        NODE_UNREACHABLE_S, or until a probe hears from the node (mark_alive). Down too,
        so the next store's plan probes them instead of trusting a recent answer."""
        ids = list(node_ids)
        if not ids:
            return
        with self.r.pipeline() as p:
            for node_id in ids:
                p.set(K.NODE_UNREACHABLE.format(node_id=node_id), 1, ex=defaults.NODE_UNREACHABLE_S)
                p.delete(K.NODE_ALIVE.format(node_id=node_id))
            p.execute()

    def unreachable(self, node_ids: Iterable[str]) -> set[str]:
        """Which of these nodes a transfer lately could not reach (mark_unreachable)."""
        ids = list(node_ids)
        if not ids:
            return set()
        return marked_unreachable(ids, self.r.mget(unreachable_keys(ids)))

    def alive(self, node_ids: Iterable[str]) -> dict[str, dict]:
        """Last stat of every node heard from within NODE_ALIVE_TTL_S."""
        ids = list(node_ids)
        if not ids:
            return {}
        raws = self.r.mget([K.NODE_ALIVE.format(node_id=n) for n in ids])
        return {n: json.loads(raw) for n, raw in zip(ids, raws, strict=True) if raw}

    def last_seen(self) -> dict[str, float]:
        """Node id -> unix time it last answered, for every node that ever did."""
        return {n: float(t) for n, t in self.r.hgetall(K.NODE_SEEN).items()}

    def declared_dead(self) -> set[str]:
        """Nodes the health sweep declared dead and has not seen come back."""
        return set(self.r.smembers(K.NODES_DEAD))

    def declare_dead(self, node_id: str) -> bool:
        """True the first time a node is declared dead (until it comes back)."""
        return bool(self.r.sadd(K.NODES_DEAD, node_id))

    def owe_manifest(self, node_id: str, vkey: str) -> None:
        """Dead `node_id` may hold a manifest of `vkey`, which a remove finished without it:
        deleted when the node answers again (crosscheck), never rebuilt meanwhile."""
        self.r.sadd(K.MANIFESTS_OWED.format(node_id=node_id), vkey)

    def manifests_owed(self, node_id: str) -> set[str]:
        return set(self.r.smembers(K.MANIFESTS_OWED.format(node_id=node_id)))

    def manifests_paid(self, node_id: str, vkeys: Iterable[str]) -> None:
        """These owed manifests are gone from `node_id` (or live again: a version of the
        same name and bytes was committed since)."""
        if vkeys := list(vkeys):
            self.r.srem(K.MANIFESTS_OWED.format(node_id=node_id), *vkeys)

    def readmit(self, node_id: str) -> bool:
        """True if the node was declared dead and is now back."""
        return bool(self.r.srem(K.NODES_DEAD, node_id))

    # --- workers -------------------------------------------------------------------

    def worker_alive(self, host: str, boot: str) -> None:
        """Refresh the TTL key saying this host's worker (started as `boot`) runs."""
        with self.r.pipeline() as p:
            p.set(K.WORKER_ALIVE.format(host=host), boot, ex=defaults.WORKER_ALIVE_TTL_S)
            p.sadd(K.WORKER_HOSTS, host)
            p.execute()

    def worker_gone(self, host: str, boot: str) -> None:
        """Drop the alive key of a worker shutting down cleanly (if it is still ours)."""
        key = K.WORKER_ALIVE.format(host=host)
        if self.r.get(key) == boot:
            self.r.delete(key)

    def worker_starting(self, host: str) -> None:
        """Say that a worker for `host` is starting (until WORKER_START_GRACE_S)."""
        self.r.set(K.WORKER_STARTING.format(host=host), 1, ex=defaults.WORKER_START_GRACE_S)

    def worker_started(self, host: str) -> None:
        self.r.delete(K.WORKER_STARTING.format(host=host))

    def worker_is_starting(self, host: str) -> bool:
        return bool(self.r.exists(K.WORKER_STARTING.format(host=host)))

    def worker_boot(self, host: str) -> str | None:
        """Boot id of the worker serving `host`, None if none was heard from lately."""
        return self.r.get(K.WORKER_ALIVE.format(host=host))

    def worker_boots(self) -> dict[str, str]:
        """Host -> boot id of every worker heard from lately (the hosts from their set, not
        a scan of the keyspace; a host whose alive key expired leaves the set)."""
        hosts = sorted(self.r.smembers(K.WORKER_HOSTS))
        boots = self.r.mget([K.WORKER_ALIVE.format(host=h) for h in hosts]) if hosts else []
        gone = [h for h, boot in zip(hosts, boots, strict=True) if boot is None]
        if gone:
            self.r.srem(K.WORKER_HOSTS, *gone)
        return {h: boot for h, boot in zip(hosts, boots, strict=True) if boot is not None}


def local_node(address: NodeAddress, stat: NodeStat, host: str) -> tuple[str, str] | None:
    """(data directory, host id) of a node on this host's loopback, for `up` to start
    again; None for a node elsewhere (its directory means nothing here)."""
    if not (address.is_loopback() and stat.data_dir):
        return None
    return stat.data_dir, host
