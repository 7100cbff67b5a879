"""What each node's scrub reported, kept in Redis for `status`.

A node's own counters restart with its process; this record keeps the latest pass
time and the number of bad copies ever found across restarts.
"""

from __future__ import annotations

import json
import time
from typing import Any

from coordinator.state import redis_keys as K
from coordinator.state.metadata import Metadata


def record(md: Metadata, node_id: str, report: dict[str, Any]) -> dict[str, Any]:
    """Merge a node's scrub report into its record; the record as saved."""
    raw = md.r.hget(K.NODE_SCRUB, node_id)
    before = json.loads(raw) if raw else {}
    quarantined = sorted(report.get("quarantined") or [])
    new_bad = set(quarantined) - set(before.get("quarantined") or [])
    finished = [
        t for t in (before.get("last_pass_finished"), report.get("last_pass_finished")) if t
    ]
    saved = {
        "at": time.time(),
        "running": bool(report.get("running")),
        "passes": int(report.get("passes") or 0),
        "scrubbed_bytes": int(report.get("scrubbed_bytes") or 0),
        "rate_bps": int(report.get("rate_bps") or 0),
        "last_pass_finished": max(finished) if finished else None,
        "quarantined": quarantined,
        "bad_found": int(before.get("bad_found") or 0) + len(new_bad),
    }
    md.r.hset(K.NODE_SCRUB, node_id, json.dumps(saved))
    return saved


def reports(md: Metadata) -> dict[str, dict[str, Any]]:
    """Node id -> its scrub record, for every node a scrub sweep has heard from."""
    return {n: json.loads(v) for n, v in md.r.hgetall(K.NODE_SCRUB).items()}
