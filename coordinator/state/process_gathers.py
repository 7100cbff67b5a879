"""Gathers a host ran in a process of its own (the CLI's, load()'s), handed to the host's
worker for its metrics. Such a process ends before any scrape could reach it, and the
training process that calls load() may keep metrics of its own, so it only records what
it did; the worker's metrics (tasks/metrics.py) take the records at each scrape and count
them with the gathers its own processes ran."""

from __future__ import annotations

import json

from coordinator.state import redis_keys as K
from coordinator.state.metadata import Metadata
from smoltorrent import defaults


def record(md: Metadata, host: str, result: dict) -> None:
    """One gather done on `host` outside its worker: its seconds, raw and wire bytes."""
    key = K.PROCESS_GATHERS.format(host=host)
    done = {k: result.get(k, 0) for k in ("seconds", "raw_bytes", "wire_bytes")}
    with md.r.pipeline() as p:
        p.rpush(key, json.dumps(done))
        p.ltrim(key, -defaults.PROCESS_GATHERS_KEPT, -1)
        p.expire(key, defaults.PROCESS_GATHERS_TTL_S)
        p.execute()


def take(md: Metadata, host: str) -> list[dict]:
    """Every record of `host` not taken yet, oldest first, removed as they are read."""
    key = K.PROCESS_GATHERS.format(host=host)
    with md.r.pipeline() as p:  # MULTI: a record pushed meanwhile stays for the next take
        p.lrange(key, 0, -1)
        p.delete(key)
        found, _ = p.execute()
    return [json.loads(x) for x in found]
