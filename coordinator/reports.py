"""What `ls` and `status` show, as plain data (the CLI renders it or prints JSON)."""

from __future__ import annotations

from coordinator.liveness import probe_registered
from coordinator.metadata import COMMITTED, Metadata


def replica_counts(md: Metadata, vkey: str, registered: set[str]) -> list[int]:
    """Verified copies per shard, counting only registered nodes."""
    manifest = md.manifest(vkey)
    return [len(md.placement(s.blob_sha256) & registered) for s in manifest.shards]


def checkpoints(md: Metadata) -> list[dict]:
    registered = set(md.nodes())
    out = []
    for name in md.names():
        current = md.current(name)
        for vkey in md.versions(name):
            v = md.version(vkey)
            counts = replica_counts(md, vkey, registered)
            replicas = int(v["replicas"])
            settled, total = md.progress(vkey)
            out.append(
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
                }
            )
    return out


def status(md: Metadata, cluster_key: bytes | None) -> dict:
    nodes = md.nodes()
    live = probe_registered(md, cluster_key)
    node_rows = []
    for node_id, rec in sorted(nodes.items(), key=lambda kv: str(kv[1].address)):
        stat = live.get(node_id)
        node_rows.append(
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
    ckpts = checkpoints(md)
    under = []
    for c in ckpts:
        if c["state"] != COMMITTED:
            continue
        live_counts = [
            len(md.placement(s.blob_sha256) & set(live)) for s in md.manifest(c["vkey"]).shards
        ]
        for i, n in enumerate(live_counts):
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
        "nodes": node_rows,
        "under_replicated": under,
        "pending": [c for c in ckpts if c["state"] == "pending"],
        "dead_letters": md.dead_letter_depth(),
    }
