"""Every message one task sends another, in one place: by task name, with its queue,
its deterministic id and its time limits.

Tasks import this module and never each other, so no two task modules form a circle.

A store run by the process that asked for it (a rank on a host no worker serves,
tasks/requests.py) runs within running_here(): the transfers, chains and commit it sends
run in that process, by Celery's eager apply of the same tasks, instead of going to a
queue no worker of its host would ever read.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

from redis.exceptions import RedisError

from coordinator import config
from coordinator.plan.manifest import Manifest
from coordinator.state import redis_keys as K
from coordinator.state.transfers import Settle, being_trimmed
from smoltorrent import defaults
from tasks.app import app
from tasks.chain_batches import ChainEntry, batches, chain_message, chain_task_id
from tasks.context import bwlimit_arg, metadata, new_request_id
from tasks.readable import transfer_repr

# Set while a store runs in the process that asked for it (running_here).
_HERE: ContextVar[bool] = ContextVar("smoltorrent_run_here", default=False)


@contextlib.contextmanager
def running_here() -> Iterator[None]:
    """Within it (this thread), a store's transfers, chains and commit run here as they
    are sent, each to its end, retries included (tasks/app.py waits out their countdown),
    a failure dead-lettered as on a worker."""
    token = _HERE.set(True)
    try:
        yield
    finally:
        _HERE.reset(token)


def _send(name: str, *, task_id: str, queue: str, args=(), kwargs=None, **options) -> None:
    """Send a task to its queue, or within running_here() run it here and now (its
    queue's worker would read the same file, on this host, with the same code)."""
    if _HERE.get():
        app.tasks[name].apply(args=args, kwargs=kwargs, task_id=task_id)
        return
    app.send_task(name, args=args, kwargs=kwargs, task_id=task_id, queue=queue, **options)


def transfer_time_limit(blob_size: int) -> int:
    """Hard limit for one transfer, sized from its bytes at the slowest rate we accept."""
    seconds = config.transfer_time_base() + blob_size // defaults.MIN_TRANSFER_RATE_BPS
    return int(min(seconds, defaults.MAX_TRANSFER_TIME_S))


def send_transfers(
    vkey: str,
    manifest: Manifest,
    targets,
    host: str,
    skip: set[str] = frozenset(),
) -> int:
    """The tasks that put every (shard, replica) not in `skip` on its node, deterministic
    ids; returns how many replicas they cover. With chain replication (the default) the
    unsettled replicas of a shard go by chain when there are two or more of them. A chunk's
    one copy at R=1, and each copy of a chunk without chain replication, is a chain of
    one node. The chunks of one chain are batched into a task (tasks/chain_batches.py).
    Otherwise (a whole shard) one transfer task per (shard, replica).

    A blob several entries use (byte-identical chunks) is delivered once, as its first
    entry, whose targets the others share (tasks/store.py): its tasks carry the later
    entries (`same`) and settle their replicas too. A replica of it is sent while any of
    those entries still waits for it."""
    sent = 0
    firsts, repeats = manifest.first_uses(), manifest.repeats()
    chains: list[ChainEntry] = []
    for index, nodes in enumerate(targets):
        if firsts[index] != index:
            continue  # delivered with the first entry of its blob
        shard = manifest.entries[index]
        same = repeats.get(index, [])
        extra = {"same": same} if same else {}
        todo = [r for r in range(len(nodes)) if any(f"{i}:{r}" not in skip for i in [index, *same])]
        chained = config.chain_replication()
        if chained and len(todo) >= 2:
            runs = [tuple(todo)]  # one chain through every unsettled replica
        elif manifest.chunked and (len(nodes) == 1 or not chained):
            # A chunk's one copy (R=1), or each copy sent from here (SMOLTORRENT_CHAIN=0): a
            # chain of one node, so a node's chunks share tasks as chains do.
            runs = [(r,) for r in todo]
        else:
            runs = None  # a whole shard's copies: a transfer task each, below
        if runs is not None:
            for run in runs:
                chain = tuple(nodes[r] for r in run)
                chains.append(ChainEntry(index, run, chain, shard.blob_sha256, tuple(same)))
            sent += len(todo) * (1 + len(same))
            continue
        limit = transfer_time_limit(shard.blob_size)
        for replica, node_id in enumerate(nodes):
            if replica not in todo:
                continue
            # Flower's line for it, with the bytes the task's own arguments do not carry.
            argsrepr, kwargsrepr = transfer_repr(
                manifest.name, index, replica, node_id, shard.blob_size
            )
            _send(
                "smoltorrent.transfer",
                kwargs={
                    "vkey": vkey,
                    "name": manifest.name,
                    "shard": index,
                    "replica": replica,
                    "node_id": node_id,
                    "digest": shard.blob_sha256,
                    **extra,
                },
                task_id=f"transfer-{vkey}-{index}-{replica}",
                queue=config.transfer_queue(host),
                time_limit=limit,
                # The soft limit lets the task close its sockets; the hard one kills it.
                soft_time_limit=max(1, limit - config.transfer_time_base() // 2),
                argsrepr=argsrepr,
                kwargsrepr=kwargsrepr,
            )
            sent += 1 + len(same)
    sizes = {e.shard: manifest.entries[e.shard].blob_size for e in chains}
    for batch in batches(chains, sizes, manifest.chunked):
        send_chain(vkey, manifest, batch, host)
    if not manifest.entries:
        # No tensors, no transfers: the barrier is complete as it stands.
        send_commit(vkey, manifest.name)
        metadata().transfers.mark_commit_enqueued(vkey)
    return sent


def chain_time_limit(transfer_limit: int) -> int:
    """Hard limit for one chain task: its nodes copy in parallel, so a chain takes about
    one transfer's time, plus the rounds that place what the chain missed (twice the
    transfer's). Never past MAX_TRANSFER_TIME_S: the visibility timeout is sized from it,
    and a task still running when it passes is delivered again and runs twice at once."""
    return min(2 * transfer_limit, defaults.MAX_TRANSFER_TIME_S)


def send_chain(vkey: str, manifest: Manifest, entries: Sequence[ChainEntry], host: str) -> None:
    """One chain task for `entries` (tasks/chain_batches.py); its id names them, so a
    re-send of the same set is the same task. Its time limit covers all their bytes."""
    blob_bytes = sum(manifest.entries[e.shard].blob_size for e in entries)
    limit = chain_time_limit(transfer_time_limit(blob_bytes))
    _send(
        "smoltorrent.chain",
        kwargs={"vkey": vkey, "name": manifest.name, **chain_message(entries)},
        task_id=chain_task_id(vkey, entries),
        queue=config.transfer_queue(host),
        time_limit=limit,
        soft_time_limit=max(1, limit - config.transfer_time_base() // 2),
    )


def send_commit(vkey: str, name: str | None = None) -> None:
    _send(
        "smoltorrent.commit",
        args=(vkey,),
        queue=config.CONTROL_QUEUE,
        task_id=f"commit-{vkey}",
        **_named(name, vkey),
    )


def _named(name: str | None, vkey: str) -> dict[str, str]:
    """Flower's line for a task whose arguments hold only a version key: the checkpoint's
    name and the version id the CLI prints, read from the version's record (tasks/readable.py
    covers the rest). Without that record (Redis away a moment), the key."""
    try:
        recorded, version_id = metadata().r.hmget(K.VERSION.format(vkey=vkey), "name", "version_id")
    except RedisError:
        recorded, version_id = None, None
    name = name or recorded
    if name is None:
        return {}
    version = f"version {version_id[:12]}" if version_id else f"version key {vkey[:12]}"
    return {"argsrepr": name, "kwargsrepr": version}


def send_store(
    path: str,
    name: str,
    replicas: int,
    shards: int | None,
    host: str,
    countdown: float = 0,
    request_id: str | None = None,
    bwlimit: int | None = None,
) -> str:
    """A store on the host that has the file (it reads the source), recorded as a request
    first (unless `request_id` names one already recorded) so no crash loses it; the
    request id, which is also the task id. `bwlimit`: bytes/s for all its sends (None: the
    worker's SMOLTORRENT_BWLIMIT)."""
    if request_id is None:
        request_id = new_request_id()
        args = {"path": path, "name": name, "replicas": replicas, "shards": shards}
        metadata().requests.open_request(request_id, "store", host, args | bwlimit_arg(bwlimit))
    app.send_task(
        "smoltorrent.store",
        args=(path, name, replicas, shards),
        kwargs={"request_id": request_id} | bwlimit_arg(bwlimit),
        task_id=request_id,
        queue=config.host_queue(host),
        countdown=countdown,
    )
    return request_id


def send_gather(
    vkey: str,
    out: str,
    host: str,
    request_id: str,
    name: str | None = None,
    tensors: list[str] | None = None,
    bwlimit: int | None = None,
) -> None:
    """A gather on the host that will hold the output, for a recorded request; with
    `tensors` (globs), of the tensors they select only; `bwlimit` as for send_store."""
    app.send_task(
        "smoltorrent.gather",
        args=(vkey, out),
        kwargs={"request_id": request_id}
        | ({} if tensors is None else {"tensors": tensors})
        | bwlimit_arg(bwlimit),
        task_id=request_id,
        queue=config.host_queue(host),
        **(
            {}
            if name is None
            else {
                "argsrepr": name,
                "kwargsrepr": f"into {out}" + (f", tensors {tensors}" if tensors else ""),
            }
        ),
    )


def redrive_request(request_id: str, record: dict[str, str]) -> None:
    """Send a recorded request's task again, with its own id: the task serves it once."""
    args = json.loads(record["args"])
    if record["kind"] == "store":
        send_store(
            args["path"],
            args["name"],
            args["replicas"],
            args["shards"],
            record["host"],
            request_id=request_id,
            bwlimit=args.get("bwlimit"),
        )
    elif record["kind"] == "gather":
        send_gather(
            args["vkey"],
            args["out"],
            record["host"],
            request_id,
            tensors=args.get("tensors"),
            bwlimit=args.get("bwlimit"),
        )


def settle(
    vkey: str,
    shard: int,
    replica: int,
    node_id: str | None,
    digest: str,
    name: str | None = None,
    held: bool = False,
    same: Sequence[int] = (),
    counts: tuple[str, str] | None = None,
) -> None:
    """Record a finished transfer, for shard `shard` and the later entries `same` with its
    blob; the one that completes the set enqueues the commit and only then marks it
    enqueued (a crash in between is found by the reconcile sweep). `held`: counted from
    the placement, not sent; `counts`: as Transfers.settle takes them."""
    settle_all(vkey, [Settle(shard, replica, node_id, digest, held)], name, same, counts)


def settle_all(
    vkey: str,
    settles: Sequence[Settle],
    name: str | None = None,
    same: Sequence[int] = (),
    counts: tuple[str, str] | None = None,
    attempts: Sequence[dict] = (),
    at: float = 0.0,
) -> None:
    """settle for each of `settles` (and for each the later entries `same` with its blob),
    after appending `attempts` stamped `at`, in one round trip (Transfers.settle_many): the
    attempts land before the settles. If one completes the set the commit is enqueued,
    then marked enqueued; a refused one (its copy being trimmed) raises
    CopyBeingTrimmedError after the others have settled."""
    every = [s._replace(shard=i) for s in settles for i in [s.shard, *same]]
    if not every and not attempts:
        return
    md = metadata()
    answers = md.transfers.settle_many(vkey, every, counts, attempts, at)
    if 1 in answers:
        send_commit(vkey, name)
        md.transfers.mark_commit_enqueued(vkey)
    refused = [s for s, answer in zip(every, answers, strict=True) if answer == -1]
    if refused:
        raise being_trimmed(refused[0].digest, refused[0].node_id)


def send_remove(vkey: str, name: str | None = None) -> None:
    """Remove a version (again: a remove is resumable and idempotent)."""
    app.send_task(
        "smoltorrent.remove",
        args=(vkey,),
        queue=config.CONTROL_QUEUE,
        task_id=f"remove-{vkey}",
        **_named(name, vkey),
    )


def send_drop_spool(vkey: str, host: str) -> None:
    """Have `host`, where the store of `vkey` encoded its chunks, remove them: the version
    is no longer pending (aborted), so nothing will send from them. The sweep deciding it
    may run on another host, and a spool is a host's own disk."""
    app.send_task(
        "smoltorrent.drop_spool",
        kwargs={"vkey": vkey},
        task_id=f"drop-spool-{vkey}",
        queue=config.host_queue(host),
    )


def repair_time_limit(size: int, rate: int) -> int:
    """Hard limit for a repair session moving `size` bytes, its source paced at `rate`
    bytes/s (0: unpaced): a transfer's, at the slower of that rate and the slowest we
    accept."""
    slowest = min(rate, defaults.MIN_TRANSFER_RATE_BPS) if rate else defaults.MIN_TRANSFER_RATE_BPS
    seconds = config.transfer_time_base() + size // slowest
    return int(min(seconds, defaults.MAX_TRANSFER_TIME_S))


def send_repair(
    digest: str, source: str, target: str, time_limit: int, more: list[str] = ()
) -> None:
    """Copy a blob (and `more`, over the same session) node to node; one id per (first
    blob, target), so a session is sent once."""
    kwargs = {"digest": digest, "source": source, "target": target}
    if more:
        kwargs["more"] = list(more)
    app.send_task(
        "smoltorrent.repair",
        kwargs=kwargs,
        task_id=f"repair-{digest}-{target}",
        queue=config.CONTROL_QUEUE,
        time_limit=time_limit,
        soft_time_limit=max(1, time_limit - config.transfer_time_base() // 2),
    )


def send_bad_copy(digest: str, node_id: str) -> None:
    """Have a copy a reader found corrupt re-hashed by its node, and repaired at once."""
    app.send_task(
        "smoltorrent.bad_copy",
        kwargs={"digest": digest, "node_id": node_id},
        task_id=f"bad-copy-{digest}-{node_id}",
        queue=config.CONTROL_QUEUE,
    )


def send_replicas(vkey: str, name: str) -> None:
    """A committed version's R changed: its blobs copied up or trimmed down to it now."""
    app.send_task(
        "smoltorrent.replicas",
        kwargs={"vkey": vkey},
        queue=config.CONTROL_QUEUE,
        **_named(name, vkey),
    )


def send_trim(digest: str, replicas: int) -> None:
    """Delete the copies of a blob above `replicas`, once the ones kept are verified."""
    app.send_task(
        "smoltorrent.trim",
        kwargs={"digest": digest, "replicas": replicas},
        task_id=f"trim-{digest}",
        queue=config.CONTROL_QUEUE,
        time_limit=defaults.TRIM_TIME_LIMIT_S,
    )
