"""The store task: parse, plan, hash and place on this host, then fan out transfers."""

from __future__ import annotations

import json
import os
import time

from celery.utils.log import get_task_logger

from coordinator import config
from coordinator.liveness import probe_registered
from coordinator.metadata import PENDING
from coordinator.store_engine import prepare_store
from smoltorrent import defaults
from smoltorrent.errors import NotEnoughNodesError
from tasks.app import app
from tasks.context import metadata

log = get_task_logger(__name__)


def transfer_time_limit(blob_size: int) -> int:
    """Hard limit for one transfer, sized from its bytes at the slowest rate we accept."""
    seconds = config.transfer_time_base() + blob_size // defaults.MIN_TRANSFER_RATE_BPS
    return int(min(seconds, defaults.MAX_TRANSFER_TIME_S))


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
    fan_out(vkey, manifest, targets, host)
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


def fan_out(vkey: str, manifest, targets, host: str, skip: set[str] = frozenset()) -> int:
    """One transfer task per (shard, replica), deterministic ids; returns how many sent."""
    from tasks.commit import commit
    from tasks.transfer import transfer

    sent = 0
    for index, nodes in enumerate(targets):
        shard = manifest.shards[index]
        limit = transfer_time_limit(shard.blob_size)
        for replica, node_id in enumerate(nodes):
            if f"{index}:{replica}" in skip:
                continue
            transfer.apply_async(
                kwargs={
                    "vkey": vkey,
                    "name": manifest.name,
                    "shard": index,
                    "replica": replica,
                    "node_id": node_id,
                    "digest": shard.blob_sha256,
                },
                task_id=f"transfer-{vkey}-{index}-{replica}",
                queue=config.transfer_queue(host),
                time_limit=limit,
                # The soft limit lets the task close its sockets; the hard one kills it.
                soft_time_limit=max(1, limit - config.transfer_time_base() // 2),
            )
            sent += 1
    if not manifest.shards:
        commit.apply_async(args=(vkey,), queue=config.CONTROL_QUEUE, task_id=f"commit-{vkey}")
    return sent


def resume_pending(host: str) -> list[str]:
    """Re-send what a killed worker of this host left undone; idempotent by design."""
    from tasks.commit import commit

    md = metadata()
    resumed = []
    for vkey in md.pending_versions():
        v = md.version(vkey)
        if v.get("host") != host:
            continue
        manifest = md.manifest(vkey)
        settled = md.settled(vkey)
        sent = fan_out(vkey, manifest, md.plan(vkey), host, skip=settled)
        if not sent and len(md.ready_shards(vkey)) == len(manifest.shards):
            commit.apply_async(args=(vkey,), queue=config.CONTROL_QUEUE, task_id=f"commit-{vkey}")
        resumed.append(vkey)
    return resumed
