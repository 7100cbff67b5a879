"""What `ls` and `status` show, as plain data (the CLI renders it or prints JSON)."""

from __future__ import annotations

from coordinator.state.liveness import probe_registered
from coordinator.state.metadata import COMMITTED, Metadata


def _shard_holders(md: Metadata, vkey: str, registered: set[str]) -> list[set[str]]:
    """Per shard, the registered nodes holding a verified copy."""
    return [md.placement(s.blob_sha256) & registered for s in md.manifest(vkey).shards]


def checkpoints(md: Metadata) -> list[dict]:
    return [row for row, _ in _versions(md)]


def _versions(md: Metadata) -> list[tuple[dict, list[set[str]]]]:
    """Every version as a listing row, with its per-shard holders for `status`."""
    registered = set(md.nodes())
    out = []
    for name in md.names():
        current = md.current(name)
        for vkey in md.versions(name):
            v = md.version(vkey)
            holders = _shard_holders(md, vkey, registered)
            counts = [len(h) for h in holders]
            replicas = int(v["replicas"])
            settled, total = md.progress(vkey)
            out.append(
                (
                    {
                        "name": name,
                        "version_id": v["version_id"],
                        "vkey": vkey,
                        "state": v["state"],
                        "current": vkey == current,
                        "size": int(v["size"]),
                        "shards": int(v["shards"]),
                        "replicas": replicas,
                        "min_copies": min(counts) if counts else replicas,
                        "under_replicated": [i for i, c in enumerate(counts) if c < replicas],
                        "transfers_settled": settled,
                        "transfers": total,
                        "created_at": float(v["created_at"]),
                        "reason": v.get("reason", ""),
                    },
                    holders,
                )
            )
    return out


def node_rows(md: Metadata, cluster_key: bytes | None) -> tuple[list[dict], set[str]]:
    """Every registered node, probed now; and the ids of those that answered."""
    nodes = md.nodes()
    live = probe_registered(md, cluster_key)
    rows = []
    for node_id, rec in sorted(nodes.items(), key=lambda kv: str(kv[1].address)):
        stat = live.get(node_id)
        rows.append(
            {
                "node_id": node_id,
                "address": str(rec.address),
                "up": stat is not None,
                "free_bytes": stat.free_bytes if stat else None,
                "total_bytes": stat.total_bytes if stat else None,
                "used_bytes": stat.used_bytes if stat else None,
                "blobs": stat.blob_count if stat else None,
            }
        )
    return rows, set(live)


def status(md: Metadata, cluster_key: bytes | None) -> dict:
    nodes, live = node_rows(md, cluster_key)
    versions = _versions(md)
    ckpts = [row for row, _ in versions]
    under = []
    for c, holders in versions:
        if c["state"] != COMMITTED:
            continue
        for i, n in enumerate(len(h & live) for h in holders):
            if n < c["replicas"]:
                under.append(
                    {
                        "name": c["name"],
                        "version_id": c["version_id"],
                        "shard": i,
                        "live_copies": n,
                        "replicas": c["replicas"],
                    }
                )
    return {
        "nodes": nodes,
        "under_replicated": under,
        "pending": [c for c in ckpts if c["state"] == "pending"],
        "dead_letters": md.dead_letter_depth(),
    }
