"""The store task: parse, plan, hash and place on this host, then fan out transfers."""

from __future__ import annotations

import json
import os
import time

from celery.utils.log import get_task_logger

from coordinator import config
from coordinator.dataplane.store_engine import prepare_store
from coordinator.state.liveness import probe_registered
from coordinator.state.metadata import PENDING
from smoltorrent import defaults
from smoltorrent.errors import NotEnoughNodesError
from tasks.app import app
from tasks.context import metadata
from tasks.enqueue import send_transfers

log = get_task_logger(__name__)


@app.task(name="smoltorrent.store", bind=True, max_retries=defaults.STABLE_RETRIES)
def store(
    self, path: str, name: str, replicas: int = defaults.DEFAULT_REPLICAS, shards: int | None = None
) -> dict:
    """Store the checkpoint at `path` (on this host) as a new version of `name`."""
    age = time.time() - os.stat(path).st_mtime
    if age < defaults.STABLE_AFTER_S:
        # Still being written: store it once training has finished the file.
        raise self.retry(countdown=defaults.STABLE_AFTER_S - age + 0.1)
    md = metadata()
    live = probe_registered(md, config.cluster_key(), trust_recent=True)
    if not live:
        raise NotEnoughNodesError(
            "no storage node is reachable"
            + (f" ({len(md.nodes())} registered, all down)" if md.nodes() else "")
            + ". Start nodes with `smoltorrent serve` and register them with "
            "`smoltorrent nodes add HOST:PORT`."
        )
    prepared = prepare_store(
        path,
        name,
        {n: s.free_bytes for n, s in live.items()},
        replicas=replicas,
        shards=shards or len(live),
        place_replicas=min(replicas, len(live)),
    )
    manifest, vkey = prepared.manifest, prepared.vkey
    targets = prefer_holders(prepared.targets, manifest, md, set(live))
    host = config.host_id()
    created = md.create_pending(
        manifest,
        vkey,
        {
            "path": path,
            "host": host,
            "task_id": self.request.id,
            "requested_shards": shards or 0,
            "identity": json.dumps(prepared.identity.to_dict()),
        },
        targets,
    )
    if not created:
        v = md.version(vkey)
        resumed = v["state"] == PENDING and v.get("task_id") == self.request.id
        if not resumed:
            log.info("%s: version %s already %s", name, manifest.version_id[:12], v["state"])
            return {"vkey": vkey, "state": v["state"], "new": False}
    send_transfers(vkey, manifest, targets, host)
    return {
        "vkey": vkey,
        "state": PENDING,
        "new": True,
        "under_replicated_at_plan": replicas > len(live),
    }


def prefer_holders(targets, manifest, md, live: set[str]) -> list[tuple[str, ...]]:
    """Keep a shard where verified copies already are: unchanged blobs move no bytes."""
    out = []
    for planned, shard in zip(targets, manifest.shards, strict=True):
        holders = sorted(md.placement(shard.blob_sha256) & live)[: len(planned)]
        rest = [n for n in planned if n not in holders]
        out.append(tuple(holders + rest[: len(planned) - len(holders)]))
    return out
