"""The store task: parse, plan, hash and place on this host, then fan out transfers.

By default a checkpoint is stored in chunks (coordinator/dataplane/chunk_engine.py): the
chunks Redis knows as stored (md.chunks), as this store would encode them, are neither
encoded nor sent, the new ones are encoded into the spool (or sent RAW,
coordinator/plan/encoding.py) and each is a blob to the transfers, placement and sweeps.
SMOLTORRENT_CHUNKS=0, or --shards N, stores whole shards (manifest schema 2)."""

from __future__ import annotations

import json
import os
import shutil
import time

from celery.utils.log import get_task_logger

from coordinator import config
from coordinator.dataplane.chunk_engine import prepare_chunked_store, spool_dir
from coordinator.dataplane.digest_cache import DigestCache
from coordinator.dataplane.store_engine import prepare_store
from coordinator.plan.chains import chain_order
from coordinator.plan.encoding import should_encode
from coordinator.state.chunks import batched
from coordinator.state.liveness import probe_registered
from coordinator.state.metadata import Metadata
from coordinator.state.requests import DONE
from coordinator.state.versions import COMMITTED, PENDING, REMOVING
from smoltorrent import defaults
from smoltorrent.errors import NotEnoughNodesError
from tasks import request_runs
from tasks.app import app
from tasks.commit import record_request_order
from tasks.context import REDIS_TRANSIENT, metadata
from tasks.enqueue import send_transfers

log = get_task_logger(__name__)


@app.task(
    name="smoltorrent.store",
    bind=True,
    # No AsyncResult kept per chain task it sends (hundreds at 16 GB), nor their ids in
    # its result: nothing reads a store's children.
    trail=False,
    max_retries=defaults.STABLE_RETRIES,
    autoretry_for=REDIS_TRANSIENT,
    retry_backoff=defaults.RETRY_BACKOFF_BASE_S,
    retry_backoff_max=defaults.RETRY_BACKOFF_MAX_S,
    retry_jitter=False,
)
def store(
    self,
    path: str,
    name: str,
    replicas: int = defaults.DEFAULT_REPLICAS,
    shards: int | None = None,
    request_id: str | None = None,
    no_node_tries: int = 0,
    bwlimit: int | None = None,
) -> dict:
    """Store the checkpoint at `path` (on this host) as a new version of `name`, for the
    request `request_id` (recorded by tasks/requests.py before this task was queued).
    `no_node_tries`: how many times it has found no live node so far. `bwlimit`: bytes/s
    for all its transfers together (None: this worker's SMOLTORRENT_BWLIMIT)."""
    md = metadata()
    if request_id is None:
        seq = md.requests.next_seq()
        return _store(self, md, path, name, replicas, shards, None, seq, bwlimit=bwlimit)
    if request_runs.start(self, md, request_id).done:
        return _result(md.requests.request(request_id))  # a re-drive of a request served
    seq = int(md.requests.request(request_id)["seq"])
    # Held while it runs: a second delivery of this task waits instead of storing twice.
    with md.requests.holding(request_id, request_runs.this_run()):
        return _store(
            self, md, path, name, replicas, shards, request_id, seq, no_node_tries, bwlimit
        )


def _store(
    self,
    md: Metadata,
    path: str,
    name: str,
    replicas: int,
    shards: int | None,
    request_id: str | None,
    seq: int,
    no_node_tries: int = 0,
    bwlimit: int | None = None,
) -> dict:
    age = time.time() - os.stat(path).st_mtime
    if age < defaults.STABLE_AFTER_S:
        # Still being written: store it once training has finished the file.
        raise self.retry(countdown=defaults.STABLE_AFTER_S - age + 0.1)
    live = probe_registered(md, config.cluster_key(), trust_recent=True)
    if not live:
        error = NotEnoughNodesError(
            "no storage node is reachable"
            + (f" ({len(md.nodes.nodes())} registered, all down)" if md.nodes.nodes() else "")
            + ". Start nodes with `smoltorrent serve` and register them with "
            "`smoltorrent nodes add HOST:PORT`."
        )
        # Nodes restarting (a power cut, an upgrade) come back in seconds: back off and
        # plan again, NO_NODE_RETRIES times, before failing the request for good.
        if no_node_tries >= config.no_node_retries():
            raise error
        raise self.retry(
            exc=error,
            countdown=defaults.RETRY_BACKOFF_BASE_S * 2**no_node_tries,
            kwargs={**self.request.kwargs, "no_node_tries": no_node_tries + 1},
        )
    free = {n: s.free_bytes for n, s in live.items()}
    if config.chunked_store() and not shards:
        registered = md.nodes.nodes()
        hosts = [registered[n].address.host for n in live if n in registered]
        prepared = prepare_chunked_store(
            path,
            name,
            free,
            config.spool_root(),
            replicas=replicas,
            place_replicas=min(replicas, len(live)),
            lookup=md.chunks.stored,
            encode=should_encode(config.encode_mode(), hosts),
            digest_cache=DigestCache(config.home() / "digest-cache"),
        )
        spans, hashed_bytes = prepared.spans, prepared.hashed_bytes
        encodings = prepared.encodings
    else:
        prepared = prepare_store(
            path,
            name,
            free,
            replicas=replicas,
            shards=shards or len(live),
            place_replicas=min(replicas, len(live)),
            digest_cache=DigestCache(config.home() / "digest-cache"),
        )
        spans, hashed_bytes = prepared.spans(), prepared.hashed_bytes
        encodings = ()
    manifest, vkey, planned = prepared.manifest, prepared.vkey, prepared.targets
    identity, tensors = json.dumps(prepared.identity.to_dict()), prepared.tensor_count
    # What it planned is held from here on in these names alone, each dropped once used:
    # a span, an entry and targets per chunk, thousands of them at 16 GB.
    del prepared
    targets = prefer_holders(planned, manifest, md, set(live))
    del planned
    if config.chain_replication():
        # Heads and tails spread so every node's outbound link carries its share.
        targets = chain_order(targets, [s.blob_size for s in manifest.entries])
    # Entries with one blob (byte-identical chunks) share its first entry's nodes: it is
    # delivered once there and settles them all (tasks/enqueue.py send_transfers).
    targets = shared_targets(targets[first] for first in manifest.first_uses())
    host = config.host_id()
    found = md.versions.create_pending(
        manifest,
        vkey,
        {
            "path": path,
            "host": host,
            "request_id": request_id or self.request.id,
            "requested_shards": shards or 0,
            "identity": identity,
        }
        | ({} if bwlimit is None else {"bwlimit": bwlimit}),
        targets,
        seq,
        tensors=tensors,
    )
    if found == REMOVING:
        # The same bytes are being removed right now: store them afresh once that is done.
        raise self.retry(countdown=defaults.REMOVING_WAIT_S)
    new = found == "created"
    # A re-drive of this same request after a crash re-sends what may not have been sent.
    mine = md.versions.version(vkey).get("request_id") == (request_id or self.request.id)
    if new or (found == PENDING and mine):
        md.chunks.record(manifest.chunks, encodings)
        # A batch a command, as the chunks are recorded: the transfers read them only
        # once sent below, and one HSET of every span's JSON was megabytes at once.
        for batch in batched(spans, defaults.CHUNK_RECORD_BATCH):
            md.transfers.keep_spans(vkey, batch)
        del spans
        send_transfers(vkey, manifest, targets, host)
    else:
        log.info("%s: version %s already %s", name, manifest.version_id[:12], found)
        if found == COMMITTED:
            # Current again if this request is the latest (a rollback): the nodes' copies
            # of its manifest learn this request's number, which orders a rebuild.
            record_request_order(md, vkey)
        if found != PENDING and manifest.chunked:
            # Nothing of it is sent: what it encoded is not needed (a pending one's
            # transfers send from this same directory).
            shutil.rmtree(spool_dir(config.spool_root(), vkey), ignore_errors=True)
    result = {
        "vkey": vkey,
        "version_id": manifest.version_id,
        "state": PENDING if new else found,
        "new": new,
        "hashed_bytes": hashed_bytes,
    }
    if request_id is not None:
        md.requests.finish_request(
            request_id,
            DONE,
            vkey=vkey,
            version_id=manifest.version_id,
            new=int(new),
            state_found=found,
            hashed_bytes=hashed_bytes,
        )
    return {**result, "under_replicated_at_plan": replicas > len(live)}


@app.task(name="smoltorrent.drop_spool", trail=False)
def drop_spool(vkey: str) -> bool:
    """Remove the spool of version `vkey` on this host (its store's encoded chunks) once
    it is no longer pending: reconcile aborted it, and nothing will send from it; whether
    it was removed. A version pending under that key (stored afresh since) keeps it."""
    spool = spool_dir(config.spool_root(), vkey)  # a key that is no version's: refused
    if metadata().versions.state(vkey) == PENDING:
        return False
    shutil.rmtree(spool, ignore_errors=True)
    return True


def _result(request: dict[str, str]) -> dict:
    return {
        "vkey": request["vkey"],
        "version_id": request.get("version_id", ""),
        "state": request.get("state_found", PENDING),
        "new": request.get("new") == "1",
        "hashed_bytes": int(request.get("hashed_bytes", 0)),
    }


def prefer_holders(targets, manifest, md, live: set[str]) -> list[tuple[str, ...]]:
    """Keep a shard where verified copies already are: unchanged blobs move no bytes."""
    out = []
    for planned, shard in zip(targets, manifest.entries, strict=True):
        holders = sorted(md.blobs.placement(shard.blob_sha256) & live)[: len(planned)]
        rest = [n for n in planned if n not in holders]
        out.append(tuple(holders + rest[: len(planned) - len(holders)]))
    return out


def shared_targets(targets) -> list[tuple[str, ...]]:
    """Each entry's nodes as a tuple, entries with the same nodes in the same order sharing
    one: a few node orders for thousands of chunks, held through the whole store task (and
    only read: the version's plan, the transfers)."""
    shared: dict[tuple[str, ...], tuple[str, ...]] = {}
    return [shared.setdefault(t, t) for t in map(tuple, targets)]
