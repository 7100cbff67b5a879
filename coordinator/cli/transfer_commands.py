"""`store` and `gather`: checkpoints (a file, or a directory of them) in and out of the
cluster, through the worker."""

from __future__ import annotations

import argparse
import os
import time

from coordinator import config
from coordinator.cli import reports
from coordinator.cli.cluster import at_label, metadata
from coordinator.cli.output import console, emit_json, human_bytes, pieces, warn
from coordinator.plan.file_pack import PACK_FILE
from coordinator.state.liveness import probe_registered
from coordinator.state.versions import COMMITTED
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError, OutcomeUnknownError, SmoltorrentError, UsageError


def _wire_words(raw: int, wire: int) -> str:
    """Raw beside wire bytes: "120.0 MB raw as 82.1 MB on the wire (1.46x)"."""
    ratio = raw / wire if wire else 1.0
    return f"{human_bytes(raw)} raw as {human_bytes(wire)} on the wire ({ratio:.2f}x)"


def _time_and_rate(size: int, seconds: float) -> str:
    """How long a summary line's transfer took and its rate: "0.31 s (85.9 MB/s)"."""
    return f"{seconds:.2f} s ({human_bytes(size / max(seconds, 1e-9))}/s)"


class _NoBar:
    """What `_progress` gives where no bar is drawn: rich.progress is not even imported."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *_) -> None:
        pass

    def add_task(self, *_, **__) -> int:
        return 0

    def update(self, *_, **__) -> None:
        pass


def _progress(as_json: bool = False):
    """A byte-level bar on a terminal; nothing in a pipe, a file or under --json (the
    summary line, or the JSON, says it all). One line at any width: the name is elided
    first, and no column shows "?" or "-:--:--" before its first reading."""
    if as_json or not console.is_terminal:
        return _NoBar()
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.table import Column
    from rich.text import Text

    class Speed(TransferSpeedColumn):
        def render(self, task):
            return Text("") if task.speed is None else super().render(task)

    class Remaining(TimeRemainingColumn):
        def render(self, task):
            if task.time_remaining is None and not task.finished:
                return Text("")
            return super().render(task)

    width = console.width
    return Progress(
        TextColumn(  # the name, as it is, elided rather than wrapped
            "{task.description}",
            markup=False,
            table_column=Column(no_wrap=True, overflow="ellipsis", max_width=max(12, width - 76)),
        ),
        TextColumn("{task.fields[pieces]}", markup=False, table_column=Column(no_wrap=True)),
        BarColumn(bar_width=max(10, min(40, width - 80))),
        DownloadColumn(table_column=Column(no_wrap=True)),
        Speed(table_column=Column(no_wrap=True)),
        Remaining(table_column=Column(no_wrap=True)),
        console=console.rich,
        transient=True,
    )


def cmd_store(args: argparse.Namespace) -> int:
    if not os.path.exists(args.path):  # said before the task modules start Redis
        # Exit 2, as a directory with nothing to store: the path given is the mistake.
        raise UsageError(f"{os.path.abspath(args.path)}: no such file or directory")
    asked = args.replicas is not None  # only an R given changes stored content's copies
    if asked:
        _check_replicas(args.replicas)
    else:
        args.replicas = defaults.DEFAULT_REPLICAS
    from tasks.requests import ctrl_c_stops_waiting, submit_store, wait_store

    if os.path.isdir(args.path):
        return _store_directory(args, asked)
    if args.all_files:
        raise UsageError("--all-files applies to a directory; a file is stored whole as it is")

    if args.name is None:
        _warn_of_another_source(os.path.abspath(args.path))
    request = submit_store(args.path, args.name, args.replicas, args.shards, bwlimit=args.bwlimit)
    name = request.name
    if args.no_wait:
        if asked:  # known only once the worker has hashed the file: say it in advance
            warn(
                f"--replicas {args.replicas} changes the copies of bytes already stored only"
                " when the store waits: if these are, they keep the copies they have"
            )
        if args.json:
            emit_json({"task_id": request.task_id, "name": name, "follow": _follow(request)})
        else:
            console.print(
                f"queued store of {name} (request {request.task_id}); it goes on without this"
                f" command: follow it with {_follow(request)}"
            )
        return 0
    started = time.monotonic()
    try:  # from here on the store is queued: Ctrl-C stops only this command's wait
        with ctrl_c_stops_waiting(), _progress(args.json) as bar:
            # The file's bytes from the start: the worker hashes it before the first reading.
            task = bar.add_task(f"storing {name}", total=os.path.getsize(args.path), pieces="")

            def show(p) -> None:
                word = "chunks" if p.chunked else "shards"
                bar.update(
                    task,
                    total=p.file_bytes,
                    completed=p.file_done_bytes,
                    pieces=f"{p.ready_shards}/{p.shards} {word}",
                )

            out = wait_store(request, show)
        replicas = args.replicas if asked else None
        with ctrl_c_stops_waiting():
            changed = _change_replicas(name, out, replicas)
    except KeyboardInterrupt:
        return _stopped_waiting("store", request, args.json)
    return _report_store(name, out, time.monotonic() - started, changed, args.json)


def _follow(request) -> str:
    return f"`smoltorrent wait {request.task_id}`"


def _stopped_waiting(kind: str, request, as_json: bool) -> int:
    """Ctrl-C stops this command following a request, not the request: it is recorded and
    the worker carries it to its end. Said so, with how to follow it; exit 3 (recorded,
    outcome not known here), not 130 as if it were lost."""
    message = (
        f"stopped waiting; the {kind} of {request.name} goes on in the background (request"
        f" {request.task_id}): follow it with {_follow(request)}, or see"
        f" `smoltorrent ls {request.name}`"
    )
    if as_json:
        emit_json({"interrupted": True, "kind": kind, "name": request.name,
                   "task_id": request.task_id, "follow": _follow(request).strip("`")})  # fmt: skip
    else:
        warn(message)
    return 3


def _warn_of_another_source(path: str) -> None:
    """A store under its default name (the file name) whose name's current version was
    stored from another file: two runs' checkpoints/step_100.safetensors became versions
    of one name without a word, and keep-last retention pruned one run for the other. Says
    where the name's versions came from and a name that keeps them apart. Never in the
    store's way: with Redis unreachable it says nothing (the store rides the outage out)."""
    name = os.path.basename(path)
    try:
        md = metadata()
        vkey = md.versions.current(name)
        came = md.versions.version(vkey) if vkey else {}
    except SmoltorrentError:
        return
    source, host = came.get("path"), came.get("host")
    if not source or (source, host) == (path, config.host_id()):
        return
    where = source if host == config.host_id() else f"{host}:{source}"
    warn(
        f"{name} holds versions stored from {where}; this one, from {path}, becomes"
        f" another version of the same name, and keep-last retention counts them together."
        f" To keep them apart, name it: --name {_distinct_name(path, source)}"
    )


def _distinct_name(path: str, other: str) -> str:
    """The shortest tail of `path` (folders and file name) that `other` does not end
    with: b/checkpoints/step_100.safetensors beside a/checkpoints/step_100.safetensors;
    the same path on another host: this host's id before the file name."""
    parts, others = path.split(os.sep), other.split(os.sep)
    for n in range(2, len(parts)):
        if parts[-n:] != others[-n:]:
            return "/".join(parts[-n:])
    return f"{config.host_id()}/{parts[-1]}"  # the same path on another host


def _change_replicas(name: str, out: dict, replicas: int | None) -> tuple[int, int] | None:
    """Content already stored, asked for another number of copies: that version's R is
    recorded (its manifest, on the nodes too) and its blobs copied up to it or trimmed
    down to it, trims only where no other version using a blob asks for more; waited for
    until every blob of it has the copies wanted. (R before, R now), or None if unchanged.
    OutcomeUnknownError when no copy is made or trimmed for a while: the change stays
    recorded and the repair sweep carries it on."""
    if replicas is None or out["new"] or out["state"] != COMMITTED:
        return None
    from coordinator.state.repair_plan import copies_against_wanted
    from tasks.enqueue import send_replicas, transfer_time_limit

    md = metadata()
    vkey = out["vkey"]
    if int(md.versions.version(vkey)["replicas"]) == replicas:
        return None
    before = md.versions.set_replicas(vkey, replicas)
    if before is None:
        raise SmoltorrentError(
            f"{name}: its version left the committed state while --replicas {replicas} was"
            " being recorded (removed meanwhile?); see `smoltorrent ls`"
        )
    send_replicas(vkey, name)
    largest = max((s.blob_size for s in md.versions.manifest(vkey).entries), default=0)
    stall = max(defaults.REPLICAS_STALL_S, transfer_time_limit(largest))
    seen, since, dead_after = None, time.monotonic(), config.dead_after()
    while (now := copies_against_wanted(md, vkey, dead_after)) and any(
        c != w for c, w in now.values()
    ):
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > stall:
            short = sum(c < w for c, w in now.values())
            raise OutcomeUnknownError(
                f"{name} now asks for {replicas} copies (recorded), but {short or 'no'}"
                f" blob(s) below and {sum(c > w for c, w in now.values())} above it have"
                f" not moved for {stall:.0f} s; the repair sweep goes on with them: see"
                " `smoltorrent status`"
            )
        time.sleep(defaults.REPLICAS_POLL_S)
    return before, replicas


def _report_store(
    name: str, out: dict, seconds: float, changed: tuple[int, int] | None, as_json: bool
) -> int:
    """A store's summary line (or JSON) once it ended; its exit status."""
    from tasks.context import metadata as client_metadata
    from tasks.requests import ride_out

    vkey = out["vkey"]
    # The store has ended: a Redis restart now must not turn it into an exit 1 (the
    # client, unlike cluster.metadata's, is not pinged first, so its errors are retried).
    md = client_metadata()
    row = ride_out(
        lambda: next(c for c in reports.checkpoints(md, name) if c["vkey"] == vkey),
        f"reading the stored version of {name} for its summary",
    )
    if as_json:
        figures = {k: out[k] for k in ("hashed_bytes", "raw_bytes", "wire_bytes", "ratio")}
        moved = {} if changed is None else {"replicas_before": changed[0]}
        emit_json({**row, "new": out["new"], **figures, **moved})
    else:
        verb = "stored" if out["new"] else "already stored (no bytes moved)"
        chunked = ride_out(
            lambda: md.versions.manifest(vkey).chunked, f"reading the manifest of {name}"
        )
        console.print(
            f"{verb}: {name} version {row['version_id'][:12]}, "
            f"{human_bytes(row['size'])} in {pieces(row['shards'], chunked)} x "
            f"{row['replicas']} replicas, "
            + (f"sent {_wire_words(out['raw_bytes'], out['wire_bytes'])}, " if out["new"] else "")
            + _time_and_rate(row["size"], seconds)
            + (
                ""
                if changed is None
                else f"; copies {'raised' if changed[1] > changed[0] else 'lowered'} from"
                f" {changed[0]} to {changed[1]}"
            )
        )
        if row["under_replicated"]:
            warn(
                f"shards {row['under_replicated']} have fewer than {row['replicas']} copies; "
                "see `smoltorrent status`."
            )
    return 0 if out["state"] == COMMITTED else 1


def _check_replicas(replicas: int) -> None:
    """Refuse, before anything is recorded, copies the nodes up now cannot hold (each copy
    of a shard goes to a different node): such a store was recorded with R, got fewer copies,
    and was reported unrepairable for ever. With no node up at all the store itself waits
    for nodes restarting together, so only a count no registered nodes could meet is
    refused then."""
    md = metadata()
    registered = len(md.nodes.nodes())
    up = len(probe_registered(md, config.cluster_key(), trust_recent=True))
    if replicas > up and (up or replicas > registered):
        raise UsageError(
            f"--replicas {replicas} asks for more copies than there are storage nodes up"
            f" ({up} of {registered} registered), and each copy of a shard goes to a different"
            f" node; store with --replicas {up} or fewer"
            + (", or " if up else ": ")
            + "start and register more nodes (`smoltorrent nodes add HOST`) first"
        )


def _store_directory(args: argparse.Namespace, asked: bool) -> int:
    """A directory of safetensors files (the Hugging Face layout) as one unit."""
    from tasks.directory_requests import store_directory

    if args.no_wait or args.shards or args.bwlimit:
        raise UsageError(
            "--no-wait, --shards and --bwlimit apply to a single file, not to a directory"
        )
    started = time.monotonic()
    stored = store_directory(args.path, args.name, args.replicas, all_files=args.all_files)
    seconds = time.monotonic() - started
    v = stored.version
    kept = stored.plan.other_files
    row = {
        "name": v.name,
        "version_id": v.version_id,
        "files": {f: m.version_id for f, m in v.files.items()},
        "index": v.index_name,
        "size": sum(m.size for m in v.files.values()),
        "new_files": stored.new_files,
        "ignored": list(stored.plan.ignored),
        "kept_files": [f.path for f in kept],  # with --all-files, in NAME/.files.safetensors
    }
    if args.json:
        emit_json(row)
        return 0
    console.print(
        f"stored directory {v.name} version {v.version_id[:12]}: {len(v.files)} files"
        + (f" and {v.index_name}" if v.index_name else "")
        + f", {human_bytes(row['size'])} ({len(stored.new_files)} new), "
        + _time_and_rate(row["size"], seconds)
    )
    if kept:
        console.print(
            f"kept {len(kept)} other files byte for byte"
            f" ({human_bytes(sum(f.size for f in kept))}) in {v.name}/{PACK_FILE}"
        )
    if stored.plan.ignored:
        why = (
            "links and special files are not followed"
            if args.all_files
            else "only .safetensors files and their index are; --all-files keeps the others too"
        )
        warn(f"not stored ({why}): " + ", ".join(stored.plan.ignored))
    kept = len(v.files) - len(stored.new_files)
    if asked and kept:
        warn(
            f"--replicas {args.replicas} does not change the copies of a directory's files"
            f" already stored: {kept} of its files keep the copies they have"
        )
    return 0


def _gather_directory(args: argparse.Namespace) -> int:
    from tasks.directory_requests import gather_directory

    if args.tensors or args.bwlimit:
        raise UsageError(
            f"{args.name} is a directory checkpoint: gather it whole, or gather --tensors or"
            f" --bwlimit from one of its files ({args.name}/FILE)"
        )
    started = time.monotonic()
    v = gather_directory(args.name, args.output, args.version)
    seconds = time.monotonic() - started
    out = os.path.abspath(args.output)
    size = sum(m.size for m in v.files.values())
    if args.json:
        emit_json({"path": out, "name": v.name, "version_id": v.version_id,
                   "files": sorted(v.files), "index": v.index_name})  # fmt: skip
    else:
        console.print(
            f"gathered directory {v.name} version {v.version_id[:12]} -> {out} "
            f"({len(v.files)} files"
            + (f" and {v.index_name}" if v.index_name else "")
            + f", {human_bytes(size)}, {_time_and_rate(size, seconds)})"
        )
    return 0


def cmd_gather(args: argparse.Namespace) -> int:
    from tasks.directory_requests import is_directory
    from tasks.requests import ctrl_c_stops_waiting, submit_gather, wait_gather

    if is_directory(args.name):
        return _gather_directory(args)
    args.name, args.version = at_label(args.name, args.version)

    request = submit_gather(
        args.name, args.output, args.version, args.tensors, bwlimit=args.bwlimit, force=args.force
    )
    try:
        with ctrl_c_stops_waiting(), _progress(args.json) as bar:
            task = bar.add_task(f"gathering {args.name}", total=request.size or 1, pieces="")
            report = wait_gather(request, lambda done, _total: bar.update(task, completed=done))
    except KeyboardInterrupt:
        if request.in_process:  # this process was the gather: it stopped with it
            raise
        return _stopped_waiting("gather", request, args.json)
    return _report_gather(request, report, args.json)


def _report_gather(request, report: dict, as_json: bool) -> int:
    if as_json:
        emit_json(report)
        return 0
    rate = report["size"] / max(report["seconds"], 1e-9)
    wire = _wire_words(report.get("raw_bytes", report["size"]), report.get("wire_bytes", 0))
    console.print(
        f"gathered {request.name} version {report['version_id'][:12]} -> {request.out} "
        f"({wire} in {report['seconds']:.2f} s, {human_bytes(rate)}/s)"
    )
    if request.tensors:
        console.print(_partial_words(report))
    for line in report["fallbacks"]:
        warn(f"fell back to another replica: {line}")
    return 0


def _partial_words(report: dict) -> str:
    """What a partial gather read and how it was checked, as it happened: the chunks
    holding the tensors (a chunked version), or the tensors' ranges of the shards (whole
    shards where their manifest has no per-tensor digests)."""
    head = (
        f"{len(report['tensors'])} tensors ({human_bytes(report.get('tensor_bytes', 0))}),"
        f" {human_bytes(report['bytes_fetched'])} read from the nodes"
    )
    if report.get("chunks_total"):
        return (
            f"{head}: {len(report['chunks_read'])} of {report['chunks_total']} chunks, each"
            " checked against its digests"
        )
    if report["whole_shards"]:
        return (
            f"{head}: shards {report['whole_shards']} read whole and checked against their"
            " digests (their manifest predates per-tensor digests)"
        )
    return f"{head}: only their byte ranges, each tensor checked against its digest"


def cmd_wait(args: argparse.Namespace) -> int:
    """Follow a store or a gather recorded earlier to its end (a `store --no-wait`, or one
    whose command was interrupted): its summary line, and the exit status it would have
    had."""
    from tasks.requests import StoreRequest, ctrl_c_stops_waiting, follow, ride_out

    md = metadata()
    try:
        record = ride_out(
            lambda: md.requests.request(args.request_id), f"reading request {args.request_id}"
        )
    except NotFoundError:
        raise NotFoundError(
            f"no request {args.request_id} is recorded here: give the whole ID that"
            " `store --no-wait` or an interrupted wait printed, on a machine using the same"
            " Redis; what is stored: `smoltorrent ls`, what is in flight: `smoltorrent status`"
        ) from None
    try:
        with ctrl_c_stops_waiting():
            request, out = follow(args.request_id)
    except KeyboardInterrupt:
        warn(f"stopped waiting; request {args.request_id} goes on in the background")
        return 3
    if isinstance(request, StoreRequest):
        seconds = time.time() - float(record["created_at"])  # since it was asked for
        # Following a request changes no copies (its R was the store's): nothing to say.
        return _report_store(request.name, out, seconds, None, args.json)
    return _report_gather(request, out, args.json)
