"""The one way in for the CLI, the watcher and the Python API: submit a store or a
gather, then follow it to its end.

Callers never build task messages themselves, so what makes a request durable and
ordered lives here and in the tasks behind it, once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import redis

from coordinator import config
from coordinator.dataplane.bandwidth import WireBytes
from coordinator.dataplane.gather_engine import check_destination
from coordinator.plan.safetensors_header import read_header
from coordinator.plan.selection import select
from coordinator.plan.version_ids import check_name
from coordinator.state import process_gathers, wakeups
from coordinator.state import redis_keys as K
from coordinator.state.metadata import Metadata
from coordinator.state.requests import DONE, FAILED, IN_PROCESS_GATHER, IN_PROCESS_STORE
from coordinator.state.versions import ABORTED, COMMITTED, REMOVED, REMOVING
from smoltorrent import defaults
from smoltorrent.errors import (
    DestinationNotAllowedError,
    MetadataError,
    NotFoundError,
    OutcomeUnknownError,
    SmoltorrentError,
    UsageError,
)
from smoltorrent.processes import alive
from smoltorrent.signal_event import SignalEvent
from tasks.context import REDIS_TRANSIENT, bwlimit_arg, metadata, new_request_id
from tasks.gathering import run_gather

T = TypeVar("T")
# A Ctrl-C noted by ctrl_c_stops_waiting. The interpreter raises KeyboardInterrupt wherever
# the main thread is, and one that lands inside an import lock's callback is printed as
# "Exception ignored" and lost: the CLI then waited on, deaf to the one Ctrl-C it got.
_CTRL_C = SignalEvent()  # set in a signal handler (smoltorrent/signal_event.py)
# Celery (tasks.app, tasks.enqueue) is imported only where a task is sent or followed: a
# gather a reader runs itself never needs it, and it is a tenth of a second of its start.


@contextmanager
def ctrl_c_stops_waiting() -> Iterator[None]:
    """Within it (main thread only), Ctrl-C raises KeyboardInterrupt as ever and is also
    noted, so the next pause between two polls raises it again if it was swallowed."""

    def noted(_signum, _frame) -> None:
        _CTRL_C.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, noted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _CTRL_C.clear()


def _pause(wake: str | None = None) -> None:
    """The wait between two polls of a request, cut short by a wake-up pushed to `wake`
    (coordinator/state/wakeups.py: whoever ends the request pushes one); KeyboardInterrupt
    on a noted Ctrl-C. Without a wake-up it lasts the poll interval, as it always did: the
    caller's next poll, not the wake-up, says what happened."""
    if wake is not None and not _CTRL_C.is_set():
        try:
            wakeups.wait(metadata().r, wake, defaults.CLI_POLL_INTERVAL_S)
        except redis.RedisError:
            # Redis away (the next poll rides the outage out), or a server before 6.0 that
            # takes no fractional BLPOP timeout: the plain pause below.
            pass
        else:
            if _CTRL_C.is_set():
                raise KeyboardInterrupt
            return
    if _CTRL_C.wait(defaults.CLI_POLL_INTERVAL_S):
        raise KeyboardInterrupt


@dataclass(frozen=True)
class StoreRequest:
    task_id: str
    name: str
    path: str


@dataclass(frozen=True)
class GatherRequest:
    task_id: str
    name: str
    vkey: str
    out: str
    size: int
    tensors: list[str] | None = None
    bwlimit: int | None = None  # bytes/s (None: the cluster's default, config.bwlimit_for)
    # No worker takes it (none serves this host, or the output lies outside where this
    # host's worker writes): wait_gather runs it in the calling process.
    in_process: bool = False


@dataclass(frozen=True)
class StoreProgress:
    done_bytes: int  # blob bytes delivered to the nodes so far, as they go on the wire
    total_bytes: int
    ready_shards: int  # shards (chunks) with a verified copy
    shards: int
    raw_done_bytes: int = 0  # the same bytes as they are in the checkpoint (decoded)
    # The checkpoint's own bytes stored so far: a chunk's raw bytes count once all its
    # copies are on their nodes (each copy a share as it goes), one stored before at once.
    file_done_bytes: int = 0
    file_bytes: int = 0
    chunked: bool = True


def error_text(exc: BaseException) -> str:
    """An error as words, never empty: its message, else its type's name."""
    return str(exc) or type(exc).__name__


def connected_metadata() -> Metadata:
    """The metadata store, checked to answer (a clear error if Redis is not there)."""
    md = metadata()
    md.ping()
    return md


def require_worker(host: str | None = None) -> None:
    """Fail fast, with the fix, when no worker would ever run the task: this host's worker
    refreshes a Redis key while it runs (tasks/heartbeat.py), so one read answers. Only
    when the key is missing (Redis was just flushed or restored) is the worker asked by
    name, which returns as soon as it answers."""
    host = host or config.host_id()
    nodes = metadata().nodes
    what = f"checking that a worker serves {host}"
    # `smoltorrent worker & smoltorrent store ...`: a worker launched with this command
    # gets WORKER_CHECK_TIMEOUT_S to say it is starting, then its Celery boot (seconds, up
    # to WORKER_START_GRACE_S) to send its first heartbeat.
    started = time.monotonic()
    while ride_out(lambda: nodes.worker_boot(host), what, recorded=False) is None:
        starting = ride_out(lambda: nodes.worker_is_starting(host), what, recorded=False)
        grace = defaults.WORKER_START_GRACE_S if starting else defaults.WORKER_CHECK_TIMEOUT_S
        if time.monotonic() - started > grace:
            break
        _pause()
    else:
        return
    name = f"smoltorrent@{host}"
    from tasks.app import app

    inspect = app.control.inspect(timeout=defaults.WORKER_CHECK_TIMEOUT_S, destination=[name])
    if not (ride_out(inspect.ping, what, recorded=False) or {}).get(name):
        raise SmoltorrentError(
            f"no smoltorrent worker is serving this host ({host}); start one with "
            "`smoltorrent worker` (or run `smoltorrent demo` for a complete local cluster)."
        )


def submit_store(
    path: str,
    name: str | None = None,
    replicas: int = defaults.DEFAULT_REPLICAS,
    shards: int | None = None,
    *,
    complete: bool = False,
    bwlimit: int | None = None,
    in_process: bool = False,
) -> StoreRequest:
    """Queue a store of the checkpoint at `path` (on this host) as a version of `name`
    (default: the file name). A bad checkpoint fails here, before anything is queued.
    `bwlimit`: bytes/s all its sends from this host keep to together (0: no limit; None:
    SMOLTORRENT_BWLIMIT, this process's if set, else the worker's).

    complete=True: the caller wrote the file whole and renamed it into place and nobody
    writes it again (the API's staged files), so the store need not wait
    STABLE_AFTER_S for it to settle: its mtime is moved back by that much.

    in_process=True (a caller that waits for the store, with wait_store): when no worker
    serves this host, the store is recorded for this process to run, and wait_store runs
    it here through the store task's own code (a rank on a host with no worker)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise SmoltorrentError(f"{path}: no such file")
    read_header(path)
    name = check_name(name or os.path.basename(path))
    if complete:
        settled = time.time() - defaults.STABLE_AFTER_S - defaults.SETTLED_MARGIN_S
        os.utime(path, (settled, settled))
    if replicas < 1:
        raise SmoltorrentError("--replicas must be at least 1")
    md = connected_metadata()
    host = config.host_id()
    if in_process and not ride_out(
        lambda: md.nodes.worker_boot(host) or md.nodes.worker_is_starting(host),
        f"checking whether a worker serves {host}",
        recorded=False,
    ):
        return _record_here(path, name, replicas, shards, host, bwlimit)
    require_worker(host)
    # The request is recorded (its sequence number orders the name's versions) before its
    # task is queued: from here on no crash loses it, and a queue that cannot be reached
    # for a while is waited out, since the store is already accepted.
    from tasks.enqueue import send_store

    request_id = new_request_id()
    bwlimit = config.bwlimit() if bwlimit is None else bwlimit
    args = {"path": path, "name": name, "replicas": replicas, "shards": shards}
    args |= bwlimit_arg(bwlimit)
    try:
        # Opening is idempotent (requests/open): tried again after a reply Redis lost, the
        # request is recorded once.
        ride_out(
            lambda: metadata().requests.open_request(request_id, "store", host, args),
            f"recording the store of {name} (request {request_id})",
        )
        ride_out(
            lambda: send_store(
                path, name, replicas, shards, host, request_id=request_id, bwlimit=bwlimit
            ),
            f"queuing the store of {name} (request {request_id})",
        )
    except KeyboardInterrupt:
        # Recorded already: if its message did not go out, the reconcile sweep sends it.
        raise OutcomeUnknownError(
            f"stopped while queuing; the store of {name} is recorded and goes on (the"
            f" reconcile sweep sends it if this did not): follow it with"
            f" `smoltorrent wait {request_id}`"
        ) from None
    return StoreRequest(task_id=request_id, name=name, path=path)


def _record_here(
    path: str, name: str, replicas: int, shards: int | None, host: str, bwlimit: int | None
) -> StoreRequest:
    """A store this process runs (wait_store), recorded first under a kind the reconcile
    sweep never sends to a worker; its sequence number orders the name's versions."""
    request_id = new_request_id()
    bwlimit = config.bwlimit() if bwlimit is None else bwlimit
    args = {"path": path, "name": name, "replicas": replicas, "shards": shards}
    args |= bwlimit_arg(bwlimit)
    ride_out(
        lambda: metadata().requests.open_request(request_id, IN_PROCESS_STORE, host, args),
        f"recording the store of {name} (request {request_id})",
        recorded=False,
    )
    return StoreRequest(task_id=request_id, name=name, path=path)


def ride_out(call: Callable[[], T], what: str, *, recorded: bool = True) -> T:
    """call(), tried again while Redis is unreachable, for up to CLIENT_OUTAGE_S: a Redis
    restart of a few seconds must not turn an accepted operation into a reported failure,
    nor fail one about to be asked for. Past that, OutcomeUnknownError when the operation
    is `recorded` (it may still complete), else MetadataError (nothing was recorded)."""
    deadline = time.monotonic() + defaults.CLIENT_OUTAGE_S
    while True:
        try:
            return call()
        except _unreachable() as exc:
            if time.monotonic() <= deadline:
                time.sleep(defaults.CLIENT_OUTAGE_POLL_S)
                continue
            unreachable = f"Redis was unreachable for {defaults.CLIENT_OUTAGE_S:.0f} s while {what}"
            if not recorded:
                raise MetadataError(
                    f"{unreachable} ({exc or type(exc).__name__}). Nothing was recorded: "
                    + config.redis_advice()
                ) from exc
            raise OutcomeUnknownError(
                f"{unreachable} ({exc or type(exc).__name__}). It is recorded and may still"
                " complete once Redis is back: check with `smoltorrent ls` before trying again."
            ) from exc


def _unreachable() -> tuple[type[BaseException], ...]:
    """What an unreachable Redis raises: the metadata client's errors and, once Celery is
    in use here, the broker's (kombu wraps a failed publish in OperationalError). kombu is
    not imported for it: a reader's in-process gather runs without Celery."""
    kombu_errors = sys.modules.get("kombu.exceptions")
    return REDIS_TRANSIENT + ((kombu_errors.OperationalError,) if kombu_errors else ())


def wait_store(
    request: StoreRequest,
    on_progress: Callable[[StoreProgress], None] | None = None,
    *,
    run_here: bool = True,
    give_up_unserved: bool = False,
) -> dict:
    """Follow a store to its commit: {"vkey", "state", "new", "hashed_bytes", "raw_bytes",
    "wire_bytes", "ratio"} (raw: the checkpoint bytes its transfers sent from this host, as
    they are in the file; wire: what the link carried for them); SmoltorrentError when it
    is abandoned, stuck on dead letters, or its task failed. A store recorded for its
    caller to run (submit_store(in_process=True)) and not yet done is run here first,
    unless run_here=False (who only follows it: another process runs it).

    give_up_unserved=True (a training step, which must not wait for a worker to come
    back): OutcomeUnknownError once no worker serves the host the store runs on. Else
    the wait lasts until a worker started again resumes the store, as the CLI's does."""
    md = metadata()
    what = f"waiting for the store of {request.name} (request {request.task_id})"
    record = ride_out(lambda: md.requests.request(request.task_id), what)
    in_process = record.get("kind") == IN_PROCESS_STORE
    if run_here and in_process and record["state"] not in (DONE, FAILED):
        _store_here(request, record)
    unserved = None
    if give_up_unserved and not in_process:
        host = record["host"]

        def unserved() -> None:
            ride_out(lambda: _require_served(md, request, host), what)

    while True:
        record = ride_out(lambda: md.requests.request(request.task_id), what)
        if record["state"] in (DONE, FAILED):
            break
        if unserved:
            unserved()
        _pause(K.REQUEST_WAKE.format(rid=request.task_id))
    if record["state"] == FAILED:
        raise SmoltorrentError(f"store of {request.name} failed: {record.get('error')}")
    vkey = record["vkey"]
    state = ride_out(lambda: _wait_commit(md, vkey, request, on_progress, unserved), what)
    raw, wire = ride_out(lambda: md.transfers.wire(vkey), what)
    return {
        "vkey": vkey,
        "state": state,
        "new": record.get("new") == "1",
        "hashed_bytes": int(record.get("hashed_bytes", 0)),
        **WireBytes(raw, wire).to_dict(),
    }


def _store_here(request: StoreRequest, record: dict[str, str]) -> None:
    """Run a store recorded for this process through the store task's own code, here: its
    plan, the transfers and chains from this host's file to the nodes, and the commit
    (tasks/enqueue.py running_here), each task's retries and dead letters as on a worker.
    A run that ends without closing its request (Redis lost meanwhile) raises what cut
    it off; the caller's next wait_store runs it again (the task resumes a request)."""
    # The task modules, and the dead-letter receiver a failed task reports to.
    import tasks.chain  # noqa: F401
    import tasks.commit  # noqa: F401
    import tasks.dead_letters  # noqa: F401
    import tasks.transfer  # noqa: F401
    from tasks.enqueue import running_here
    from tasks.store import store

    args = json.loads(record["args"])
    kwargs = {"request_id": request.task_id} | bwlimit_arg(args.get("bwlimit"))
    with running_here():
        result = store.apply(
            args=(args["path"], args["name"], args["replicas"], args["shards"]),
            kwargs=kwargs,
            task_id=request.task_id,
        )
    if result.failed():
        state = ride_out(
            lambda: metadata().requests.request(request.task_id)["state"],
            f"reading the store of {request.name} (request {request.task_id})",
        )
        if state not in (DONE, FAILED):
            raise result.result


def _require_served(md: Metadata, request: StoreRequest, host: str) -> None:
    """OutcomeUnknownError when no worker serves `host`: none heard from within
    WORKER_ALIVE_TTL_S (killed, or its machine lost), and none starting. Its store's
    request stays recorded: the worker resumes it when it starts (the reconcile sweep)."""
    if md.nodes.worker_boot(host) is None and not md.nodes.worker_is_starting(host):
        raise OutcomeUnknownError(
            f"no worker serves {host} any more (none heard from for"
            f" {defaults.WORKER_ALIVE_TTL_S} s): the store of {request.name} is recorded and"
            " goes on once one starts (`smoltorrent worker`); follow it with"
            f" `smoltorrent wait {request.task_id}`"
        )


def _wait_commit(
    md: Metadata,
    vkey: str,
    request: StoreRequest,
    on_progress: Callable[[StoreProgress], None] | None,
    unserved: Callable[[], None] | None = None,
) -> str:
    name = request.name
    manifest = md.versions.manifest(vkey)
    sizes = [s.blob_size for s in manifest.entries]
    # What a blob's bytes are in the checkpoint (a shard's blob: itself; an encoded chunk's:
    # its raw bytes), so the bar can say raw beside wire as they go.
    raw_per_byte = [
        (s.data_end - s.data_start) / s.blob_size if manifest.chunked else 1.0
        for s in manifest.entries
    ]
    plan = md.transfers.plan(vkey)
    total = sum(sizes[i] * len(t) for i, t in enumerate(plan))
    raw_sizes = [s.data_end - s.data_start for s in manifest.entries]
    # What the file's bytes still to store are: those of every chunk a copy is sent of.
    to_store = sum(raw_sizes[i] for i, t in enumerate(plan) if t)
    while True:
        # One consistent read: a transfer settling between two reads cannot make a store
        # that commits look stuck.
        v, settled, ready = md.transfers.snapshot(vkey)
        if on_progress:
            # Settled transfers count whole; running ones by the bytes they have sent.
            done = {m: sizes[int(m.split(":")[0])] for m in settled}
            for member, sent in md.transfers.sent(vkey).items():
                if member not in settled:
                    done[member] = min(sent, sizes[int(member.split(":")[0])])
            raw = sum(n * raw_per_byte[int(m.split(":")[0])] for m, n in done.items())
            stored = sum(
                n * raw_sizes[i] / max(sizes[i], 1) / len(plan[i])
                for m, n in done.items()
                if plan[i := int(m.split(":")[0])]
            )
            on_progress(
                StoreProgress(
                    sum(done.values()),
                    total,
                    len(ready),
                    len(sizes),
                    int(raw),
                    file_done_bytes=min(
                        manifest.source_size, manifest.source_size - to_store + int(stored)
                    ),
                    file_bytes=manifest.source_size,
                    chunked=manifest.chunked,
                )
            )
        if v["state"] == COMMITTED:
            return COMMITTED
        if v["state"] == ABORTED:
            raise SmoltorrentError(f"store of {name} abandoned: {v.get('reason')}")
        if v["state"] in (REMOVING, REMOVED):
            raise SmoltorrentError(f"store of {name}: the version was removed meanwhile.")
        missing = sorted(set(range(len(sizes))) - ready)
        if len(settled) >= int(v["transfers"]) and missing:
            raise SmoltorrentError(
                f"store of {name} is stuck: shards {missing} reached no node. Its failed "
                "transfers are dead letters (`smoltorrent dlq ls`); fix the nodes, then "
                "`smoltorrent dlq replay --all` completes it."
            )
        if md.dead_letters.has_dead_letter(f"commit-{vkey}"):
            # Not a failure: a complete barrier without a commit is what the reconcile
            # sweep sends a commit for, every pass, so the version may commit yet (the
            # chaos run saw an exit 1 here and then the commit).
            raise OutcomeUnknownError(
                f"store of {name}: every shard landed but its commit ran out of retries "
                f"({md.dead_letters.dead_letter(f'commit-{vkey}')['error']}). The reconcile"
                " sweep sends the commit again: follow it with"
                f" `smoltorrent wait {request.task_id}`, or send it now with"
                f" `smoltorrent dlq replay commit-{vkey}`."
            )
        if unserved:  # the transfers and the commit run on that host's worker too
            unserved()
        _pause(K.VERSION_WAKE.format(vkey=vkey))  # the commit pushes it


def _refuse_replacing(out: str) -> None:
    """UsageError if `out` exists and is not a file a gather may replace: an earlier
    .safetensors checkpoint (its header reads). Anything else (a password file, a link,
    a device) stays unless the user says --force: a typo in -o must never cost a file."""
    if not os.path.lexists(out):
        return
    if os.path.islink(out):
        what = f"a link to {os.readlink(out)}"
    elif not os.path.isfile(out):
        what = "not a regular file"
    else:
        try:
            read_header(out)
            return
        except (SmoltorrentError, OSError):
            what = f"a file of {os.path.getsize(out)} bytes that is not a checkpoint"
    raise UsageError(
        f"{out} exists: {what}. gather replaces only an earlier .safetensors checkpoint;"
        " choose another -o, or pass --force to replace it"
    )


def submit_gather(
    name: str,
    out: str,
    version: str | None = None,
    tensors: list[str] | None = None,
    *,
    bwlimit: int | None = None,
    force: bool = False,
) -> GatherRequest:
    """Ask for a gather of `name` (its current version, or a version id prefix) into the
    file `out` on this host: queued for this host's worker or, with none to take it, run
    by wait_gather in this process. With `tensors` (globs), of the tensors they match
    only, as a .safetensors file of their own. A glob matching no tensor fails here.
    `bwlimit`: bytes/s it receives at most, as for submit_store. A file already at `out`
    is replaced only if it is a checkpoint, or with `force` (UsageError otherwise)."""
    md = connected_metadata()
    reading = f"reading what to gather of {name}"
    vkey = ride_out(lambda: md.versions.resolve(name, version), reading, recorded=False)
    if tensors is None:
        size = int(ride_out(lambda: md.versions.version(vkey), reading, recorded=False)["size"])
    else:
        size = select(
            ride_out(lambda: md.versions.manifest(vkey), reading, recorded=False), tensors
        ).size
    out = os.path.abspath(out)
    if os.path.isdir(out):  # as cp does: into that directory, under the checkpoint's file name
        out = os.path.join(out, os.path.basename(name))
    if not os.path.isdir(os.path.dirname(out)):
        raise SmoltorrentError(f"{os.path.dirname(out)}: no such directory for the output")
    if not force:
        _refuse_replacing(out)
    host = config.host_id()
    request_id = new_request_id()
    bwlimit = config.bwlimit() if bwlimit is None else bwlimit
    if not ride_out(lambda: _worker_takes(md, host, out), reading, recorded=False):
        if not os.access(os.path.dirname(out), os.W_OK):
            raise SmoltorrentError(
                f"cannot write in {os.path.dirname(out)}: permission denied. Choose an output"
                " in a directory you can write."
            )
        return GatherRequest(request_id, name, vkey, out, size, tensors, bwlimit, True)
    from tasks.enqueue import send_gather

    args = {"vkey": vkey, "out": out} | _tensors(tensors) | bwlimit_arg(bwlimit)
    ride_out(
        lambda: md.requests.open_request(request_id, "gather", host, args),
        f"recording the gather of {name} (request {request_id})",
    )
    ride_out(
        lambda: send_gather(vkey, out, host, request_id, name, tensors, bwlimit),
        f"queuing the gather of {name} (request {request_id})",
    )
    return GatherRequest(request_id, name, vkey, out, size, tensors, bwlimit)


def _tensors(tensors: list[str] | None) -> dict:
    return {} if tensors is None else {"tensors": tensors}


def _worker_takes(md: Metadata, host: str, out: str) -> bool:
    """Whether this host's worker gathers into `out`: one serves the host (its heartbeat
    key is there) and `out` lies where it writes a gather sent through the broker (the
    staging directory and SMOLTORRENT_GATHER_DIRS). Otherwise the caller gathers."""
    try:
        check_destination(out, config.gather_dirs())
    except DestinationNotAllowedError:
        return False
    return md.nodes.worker_boot(host) is not None


def _gather_here(request: GatherRequest, on_progress: Callable[[int, int], None] | None) -> dict:
    """Run an in-process gather request through the gather task's own code (engine,
    replica fallback, verification, reader mark) and close its record."""
    md = metadata()
    host = config.host_id()
    args = {"vkey": request.vkey, "out": request.out} | _tensors(request.tensors)
    args |= bwlimit_arg(request.bwlimit)
    what = f"gathering {request.name} (request {request.task_id})"

    def record() -> None:
        # Recorded all the same, before a byte moves, under a kind the reconcile sweep
        # never sends to a worker: this process is what runs it. Nothing is written
        # until it is, so an outage here fails with nothing to undo.
        md.requests.open_request(request.task_id, IN_PROCESS_GATHER, host, args)
        md.requests.start_request(request.task_id, f"process:{host}:{os.getpid()}")

    ride_out(record, what, recorded=False)
    reader = f"{host}:{os.getpid()}:{request.task_id}"
    try:
        # A Redis error out of the gather came before its output was renamed into place
        # (nothing of it is left): the gather is simply run again once Redis is back.
        result = ride_out(
            lambda: run_gather(
                md, request.vkey, request.out, request.tensors, reader, on_progress, request.bwlimit
            ),
            what,
            recorded=False,
        )
    except BaseException as exc:
        error = error_text(exc)
        with contextlib.suppress(SmoltorrentError):
            ride_out(
                lambda: md.requests.finish_request(request.task_id, FAILED, error=error),
                what,
            )
        if isinstance(exc, OSError):  # the output's disk or directory, as the user can fix
            raise SmoltorrentError(
                f"gather of {request.name} into {request.out} failed: {exc}. Nothing was"
                " written there."
            ) from exc
        raise
    # The file is in place, whole and verified: the gather succeeded whatever happens to
    # its record now (an exit 1 here left a good file behind a reported failure).
    with contextlib.suppress(SmoltorrentError):
        ride_out(
            lambda: md.requests.finish_request(request.task_id, DONE, result=json.dumps(result)),
            what,
        )
    with contextlib.suppress(redis.RedisError):  # a metric never fails a gather
        process_gathers.record(md, host, result)
    return result


def wait_gather(
    request: GatherRequest, on_progress: Callable[[int, int], None] | None = None
) -> dict:
    """Follow a gather to its end (run it, when it is in_process); its report, or
    SmoltorrentError naming what failed. on_progress(done_bytes, total_bytes) is called as
    bytes arrive."""
    if request.in_process:
        return _gather_here(request, on_progress)
    from tasks.app import app

    md = metadata()
    res = app.AsyncResult(request.task_id)
    what = f"waiting for the gather of {request.name} (request {request.task_id})"

    def failed(error: str | None) -> SmoltorrentError:
        return SmoltorrentError(
            f"gather of {request.name} failed: {error}. Nothing was written at {request.out}."
        )

    def look() -> dict | None:
        """The gather's report once it is done, else None."""
        # Its record says done (and the task wakes this wait) a moment before Celery
        # stores the task's result: read it first.
        record = None
        with contextlib.suppress(NotFoundError):
            record = md.requests.request(request.task_id)
        state = record["state"] if record is not None else None
        if state == DONE and "result" in record:
            return json.loads(record["result"])
        if state == FAILED:
            raise failed(record.get("error"))
        if res.ready():
            if not res.failed():
                return res.result
            # A run cut off from Redis failed in Celery's eyes but left its request open:
            # it is sent again (tasks/dead_letters.py), so only a closed record is the end.
            if record is None:
                raise failed(error_text(res.result))
            return None
        if on_progress and res.state == "PROGRESS" and isinstance(res.info, dict):
            on_progress(res.info.get("done", 0), request.size)
        return None

    while (report := ride_out(look, what)) is None:
        _pause(K.REQUEST_WAKE.format(rid=request.task_id))
    return report


def follow(rid: str) -> tuple[StoreRequest | GatherRequest, dict]:
    """Follow request `rid` to its end, whoever asked for it (a `store --no-wait`, a store
    or gather whose caller stopped waiting): the request, and the report wait_store or
    the gather gives. SmoltorrentError when it failed, NotFoundError when no such request
    is recorded (a finished one is kept REQUEST_TTL_S)."""
    md = connected_metadata()
    what = f"following request {rid}"
    record = ride_out(lambda: md.requests.request(rid), what)
    args = json.loads(record["args"])
    if record["kind"] in ("store", IN_PROCESS_STORE):
        request = StoreRequest(rid, args["name"], args["path"])
        return request, wait_store(request, run_here=False)  # its own process runs it
    if record["kind"] not in ("gather", IN_PROCESS_GATHER):
        raise SmoltorrentError(f"request {rid} is a {record['kind']}, not a store or a gather")
    version = ride_out(lambda: md.versions.version(args["vkey"]), what)
    gather = GatherRequest(
        rid, version["name"], args["vkey"], args["out"], int(version["size"]), args.get("tensors")
    )
    what = f"waiting for the gather of {gather.name} (request {rid})"
    while record["state"] not in (DONE, FAILED):
        _check_gathering_process(rid, record)
        _pause(K.REQUEST_WAKE.format(rid=rid))
        record = ride_out(lambda: md.requests.request(rid), what)
    if record["state"] == FAILED:
        raise SmoltorrentError(f"gather of {gather.name} failed: {record.get('error')}")
    return gather, json.loads(record["result"])


def _check_gathering_process(rid: str, record: dict[str, str]) -> None:
    """A gather run by the process that asked for it ends with that process: one of this
    host's that is gone will never finish it (another host's cannot be asked)."""
    kind, _, where = record.get("boot", "").partition(":")
    host, _, pid = where.partition(":")
    if kind != "process" or host != config.host_id() or not pid.isdigit():
        return
    if not alive(int(pid)):
        raise SmoltorrentError(
            f"gather request {rid} was run by process {pid}, which ended before it did;"
            " nothing was written. Run the gather again."
        )


def submit_remove(vkey: str) -> None:
    """Remove a version: marked removing at once (no gather takes it from here on, and the
    reconcile sweep resumes the remove after any crash), then its remove task is queued."""
    md = connected_metadata()
    from tasks.enqueue import send_remove

    md.removals.begin_remove(vkey)
    send_remove(vkey)
