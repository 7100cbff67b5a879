"""What `ls`, `show` and `status` show, as plain data (the CLI renders it or prints JSON)."""

from __future__ import annotations

import struct
from collections import Counter

from coordinator import config
from coordinator.plan.directory import RECORD_FILE
from coordinator.plan.file_pack import PACK_FILE
from coordinator.plan.safetensors_header import LENGTH_PREFIX_BYTES, parse_header
from coordinator.state import repairs, scrub_reports
from coordinator.state.directories import Directories
from coordinator.state.liveness import node_health, probe_registered
from coordinator.state.metadata import Metadata
from coordinator.state.versions import COMMITTED
from smoltorrent.errors import NotFoundError

_INTERNAL = (RECORD_FILE, PACK_FILE)  # a directory checkpoint's members no user wrote


def checkpoints(md: Metadata, name: str | None = None) -> list[dict]:
    """Every version of every checkpoint, or of `name` only (NotFoundError if unknown), or,
    with `name` ending in "/" or naming a directory checkpoint, of every name under that
    prefix. A directory checkpoint's internal members, its record
    (NAME/.directory.safetensors) and the pack of its other files (NAME/.files.safetensors,
    stored with --all-files), are listed only when named."""
    if name is not None and not name.endswith("/") and not md.versions.has_name(name):
        if not Directories(md.r).is_directory(name):
            raise NotFoundError(f"no checkpoint named {name}; `smoltorrent ls` lists them.")
        name += "/"  # a directory checkpoint: its files, as `ls NAME/` lists them
    if name is not None and not name.endswith("/"):
        rows = [row for row, _, _ in _versions(md, name)]
    else:
        # A prefix reads every summary and keeps its own: the listing is one sorted set of
        # all versions, a few round trips whatever their number.
        rows = [
            row
            for row, _, _ in _versions(md)
            if row["name"].startswith(name or "")
            and row["name"].rpartition("/")[2] not in _INTERNAL
        ]
    labels = md.versions.labels([row["vkey"] for row in rows])  # one more round trip
    for row in rows:
        row["pinned"], row["tags"] = labels[row["vkey"]]
    return rows


def _versions(
    md: Metadata,
    name: str | None = None,
    live: set[str] | None = None,
    notable: set[str] | None = None,
) -> list[tuple[dict, list[str], list[int]]]:
    """Every version as a listing row (with `notable`, the blobs of repairs: only the rows
    `status` reports, with their shards' blobs) and, when `live` is given (for `status`),
    its live copies per shard. Read from the listing summaries in a few round trips whatever
    the number of versions: no manifest is read."""
    registered = set(md.nodes.nodes())
    # With every registered node live, the live copies are the copies: not counted twice.
    live_differs = live is not None and not registered <= live
    summaries = md.listing.version_summaries(
        name, registered, live & registered if live_differs else None, bool(notable), notable
    )
    out = []
    for row in summaries:
        blobs, copies, live_copies = row.pop("digests", []), row.pop("copies"), row.pop("live")
        out.append((row, blobs, live_copies if live_differs else copies))
    return out


def node_rows(md: Metadata, cluster_key: bytes | None) -> tuple[list[dict], set[str]]:
    """Every registered node, probed now (up, down or dead, and when it last answered);
    and the ids of those that answered."""
    nodes = md.nodes.nodes()
    live = probe_registered(md, cluster_key)
    health = node_health(md, config.dead_after(), set(live))
    scrubs = scrub_reports.reports(md)
    rows = []
    for node_id, rec in sorted(nodes.items(), key=lambda kv: str(kv[1].address)):
        stat = live.get(node_id)
        scrub = scrubs.get(node_id, {})
        rows.append(
            {
                "last_scrub": scrub.get("last_pass_finished"),
                "scrubbing": scrub.get("running", False),
                "bad_copies_found": scrub.get("bad_found", 0),
                "quarantined": len(scrub.get("quarantined", [])),
                "node_id": node_id,
                "address": str(rec.address),
                "up": stat is not None,
                "state": health[node_id].state,
                "last_seen": health[node_id].last_seen,
                "free_bytes": stat.free_bytes if stat else None,
                "total_bytes": stat.total_bytes if stat else None,
                "used_bytes": stat.used_bytes if stat else None,
                "blobs": stat.blob_count if stat else None,
            }
        )
    return rows, set(live)


def status(md: Metadata, cluster_key: bytes | None) -> dict:
    nodes, live = node_rows(md, cluster_key)
    in_flight = sorted(repairs.in_flight(md), key=lambda r: (r.digest, r.target))
    waiting = sorted(repairs.backing_off(md), key=lambda b: (b.until, b.digest))
    # Only the versions reported below (pending, under R, or named by a repair) come back:
    # a healthy cluster's thousands of versions are neither sent nor parsed.
    versions = _versions(
        md, live=live, notable={r.digest for r in in_flight} | {b.digest for b in waiting}
    )
    ckpts = [row for row, _, _ in versions]
    names_of: dict[str, set[str]] = {}  # blob -> checkpoints using it, for the repairs
    for c, digests, _ in versions:
        for digest in digests:
            names_of.setdefault(digest, set()).add(c["name"])
    under = []
    for c, _, live_copies in versions:
        if c["state"] != COMMITTED:
            continue
        for i, n in enumerate(live_copies):
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
        "summary": _summary(nodes, under),
        "nodes": nodes,
        "under_replicated": under,
        "unrepairable": [
            {"digest": d, **info} for d, info in sorted(repairs.unrepairable(md).items())
        ],
        "repairs_in_flight": [
            {
                "digest": r.digest,
                "source": r.source,
                "target": r.target,
                "size": r.size,
                "names": sorted(names_of.get(r.digest, ())),
            }
            for r in in_flight
        ],
        "repairs_waiting": [
            {
                "digest": b.digest,
                "target": b.target,
                "failures": b.failures,
                "until": b.until,
                "error": b.error,
                "names": sorted(names_of.get(b.digest, ())),
            }
            for b in waiting
        ],
        "repairs_done": repairs.counts(md),
        "pending": [c for c in ckpts if c["state"] == "pending"],
        "dead_letters": md.dead_letters.dead_letter_depth(),
    }


def _summary(nodes: list[dict], under: list[dict]) -> dict:
    """The one line a person or a monitor reads first: healthy means every committed
    shard has a live copy (a shard short of its replicas is repaired by the sweeps; a shard
    with none can be read by no one until a node holding it comes back)."""
    without_copy = sum(u["live_copies"] == 0 for u in under)
    return {
        "healthy": without_copy == 0,
        "nodes_up": sum(n["up"] for n in nodes),
        "nodes": len(nodes),
        "under_replicated_shards": len(under),
        "shards_without_copy": without_copy,
    }


def header(md: Metadata, name: str, version: str | None = None) -> dict:
    """The safetensors header of a version (its current one by default), read from its
    manifest alone: no node is asked and no tensor byte moves."""
    vkey = md.versions.resolve(name, version)
    v = md.versions.version(vkey)
    manifest = md.versions.manifest(vkey)
    parsed = parse_header(
        struct.pack("<Q", len(manifest.header_bytes)),
        manifest.header_bytes,
        manifest.source_size,
        source=f"manifest of {name}",
    )
    tensors = [
        {
            "name": t.name,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "bytes": t.size,
            "offset": t.start,
            "shard": manifest.entry_of(t),
        }
        for t in parsed.tensors
    ]
    return {
        "name": name,
        "version_id": v["version_id"],
        "state": v["state"],
        "current": vkey == md.versions.current(name),
        "size": manifest.source_size,
        "header_bytes": LENGTH_PREFIX_BYTES + len(manifest.header_bytes),
        "shards": len(manifest.entries),
        "chunked": manifest.chunked,
        "tensor_count": len(tensors),
        "parameters": sum(_numel(t["shape"]) for t in tensors),
        "dtypes": dict(sorted(Counter(t["dtype"] for t in tensors).items())),
        "metadata": parsed.metadata or {},
        "tensors": tensors,
    }


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
