"""The CLI commands that talk to Redis and the Celery worker."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from coordinator import config
from coordinator.cli import reports
from coordinator.cli.output import console, emit_json, error, human_bytes, table, warn
from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.state.metadata import COMMITTED, Metadata
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError, SmoltorrentError, UsageError


def _md() -> Metadata:
    """The metadata store, checked to answer. Made here rather than through the task
    modules: a command that only reads Redis (ls, status, show, ...) does not import
    Celery, a tenth of a second of its start."""
    from coordinator.state.embedded_redis import ensure_redis_url

    md = Metadata(ensure_redis_url())
    md.ping()
    return md


def _require_worker() -> None:
    from tasks.requests import require_worker

    require_worker()


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
    summary line, or the JSON, says it all)."""
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

    return Progress(
        TextColumn("{task.description}", markup=False),  # the name, as it is
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console.rich,
        transient=True,
    )


# --- nodes ---------------------------------------------------------------------


def _addresses(texts: list[str], default_port: int | None = None) -> list[NodeAddress]:
    """Every address given on the command line, all parsed before any is used: a malformed
    one is a usage error, and nothing is done."""
    try:
        return [NodeAddress.parse(text, default_port) for text in texts]
    except SmoltorrentError as exc:
        raise UsageError(str(exc)) from exc


def cmd_nodes(args: argparse.Namespace) -> int:
    md = _md()
    if args.nodes_command == "add":
        rows = []
        for address in _addresses(args.addresses, defaults.DEFAULT_PORT):
            stat = NodeClient(
                address, cluster_key=config.cluster_key(), timeout=defaults.CONNECT_TIMEOUT_S
            ).stat()
            md.add_node(stat.node_id, address)
            md.mark_alive(stat.node_id, stat.__dict__)
            rows.append(
                {
                    "node_id": stat.node_id,
                    "address": str(address),
                    "free_bytes": stat.free_bytes,
                    "blobs": stat.blob_count,
                }
            )
        if args.json:
            emit_json(rows)
        else:
            for r in rows:
                console.print(
                    f"added node {r['node_id'][:12]} at {r['address']} "
                    f"({human_bytes(r['free_bytes'])} free, {r['blobs']} blobs)"
                )
        return 0
    if args.nodes_command == "ls":
        nodes, _ = reports.node_rows(md, config.cluster_key())
        if args.json:
            emit_json(nodes)
        else:
            table(
                "nodes",
                ["id", "address", "state", "free", "used", "blobs"],
                [
                    (
                        n["node_id"][:12],
                        n["address"],
                        _NODE_STATE[n["state"]],
                        human_bytes(n["free_bytes"]) if n["up"] else "-",
                        human_bytes(n["used_bytes"]) if n["up"] else "-",
                        n["blobs"] if n["up"] else "-",
                    )
                    for n in nodes
                ],
            )
        return 0
    matches = [
        nid
        for nid, rec in md.nodes().items()
        if nid.startswith(args.node) or str(rec.address) == args.node
    ]
    if len(matches) != 1:
        raise NotFoundError(
            f"{'no' if not matches else 'several'} registered nodes match "
            f"'{args.node}'; see `smoltorrent nodes ls`."
        )
    md.remove_node(matches[0])
    if args.json:
        emit_json({"removed": matches[0]})
        return 0
    console.print(
        f"removed node {matches[0][:12]}; its shards count as missing until they are re-replicated."
    )
    return 0


def cmd_discover(args: argparse.Namespace) -> int:
    from coordinator.discovery import browse, register

    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: give a number of seconds above 0")
    found = browse(args.timeout)
    md = _md()
    known = md.nodes()
    rows = []
    for item in found:
        row = {**item.to_dict(), "registered": "no"}
        if item.node_id in known:
            same = str(known[item.node_id].address) == str(item.address)
            row["registered"] = "yes" if same else f"at {known[item.node_id].address}"
        if args.register:
            try:
                outcome, address = register(md, item, config.cluster_key())
                row |= {"registered": "yes", "outcome": outcome, "address": str(address)}
            except SmoltorrentError as exc:
                row |= {"outcome": "error", "error": str(exc)}
        rows.append(row)
    if args.json:
        emit_json(rows)
        return 0 if all(r.get("outcome") != "error" for r in rows) else 1
    if not rows:
        console.print(
            f"no node answered within {args.timeout:g} s: nodes advertise themselves when they"
            " listen beyond loopback (a cluster key or --insecure) and multicast reaches here;"
            " otherwise register them with `smoltorrent nodes add HOST`"
        )
        return 0
    table(
        "nodes found",
        ["id", "address", "protocol", "metrics", "registered"]
        + (["result"] if args.register else []),
        [
            (
                r["node_id"][:12],
                r["address"],
                r["protocol"] if r["protocol"] is not None else "-",
                r["metrics_port"] or "-",
                r["registered"],
                *([r.get("error") or r["outcome"]] if args.register else []),
            )
            for r in rows
        ],
    )
    if not args.register and any(r["registered"] != "yes" for r in rows):
        console.print("`smoltorrent discover --register` registers them")
    return 0 if all(r.get("outcome") != "error" for r in rows) else 1


# --- flower --------------------------------------------------------------


def cmd_flower(args: argparse.Namespace) -> int:
    from tasks.app import REDIS_URL

    env = dict(os.environ, SMOLTORRENT_REDIS_URL=REDIS_URL)
    extra = args.flower_options[1:] if args.flower_options[:1] == ["--"] else args.flower_options
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tasks.app",
        "flower",
        f"--port={args.port}",
        f"--address={args.address}",
        f"--tasks-columns={defaults.FLOWER_TASKS_COLUMNS}",
        *extra,  # after ours: Flower takes the last value given
    ]
    sys.stdout.flush()
    sys.stderr.flush()
    # Become Flower rather than wait on it: a SIGTERM or SIGKILL sent to this command
    # then reaches Flower itself, and nothing is left behind listening on the port.
    os.execve(sys.executable, command, env)


# --- store, gather -----------------------------------------------------------------


def cmd_store(args: argparse.Namespace) -> int:
    if not os.path.exists(args.path):  # said before the task modules start Redis
        raise SmoltorrentError(f"{os.path.abspath(args.path)}: no such file")
    from tasks.requests import submit_store, wait_store

    if os.path.isdir(args.path):
        return _store_directory(args)

    request = submit_store(args.path, args.name, args.replicas, args.shards)
    name = request.name
    if args.no_wait:
        if args.json:
            emit_json({"task_id": request.task_id, "name": name})
        else:
            console.print(f"queued store of {name} (task {request.task_id})")
        return 0
    started = time.monotonic()
    with _progress(args.json) as bar:
        task = bar.add_task(f"storing {name}", total=1)

        def show(p) -> None:
            bar.update(
                task,
                total=p.total_bytes or 1,
                completed=p.done_bytes,
                description=f"storing {name} ({p.ready_shards}/{p.shards} shards)",
            )

        out = wait_store(request, show)
    seconds = time.monotonic() - started
    md = _md()
    vkey = out["vkey"]
    row = next(c for c in reports.checkpoints(md, name) if c["vkey"] == vkey)
    if args.json:
        emit_json({**row, "new": out["new"], "hashed_bytes": out["hashed_bytes"]})
    else:
        verb = "stored" if out["new"] else "already stored (no bytes moved)"
        console.print(
            f"{verb}: {name} version {row['version_id'][:12]}, "
            f"{human_bytes(row['size'])} in {row['shards']} shards x "
            f"{row['replicas']} replicas, {_time_and_rate(row['size'], seconds)}"
        )
        if row["under_replicated"]:
            warn(
                f"shards {row['under_replicated']} have fewer than {row['replicas']} copies; "
                "see `smoltorrent status`."
            )
    return 0 if out["state"] == COMMITTED else 1


def _store_directory(args: argparse.Namespace) -> int:
    """A directory of safetensors files (the Hugging Face layout) as one unit."""
    from tasks.directory_requests import store_directory

    if args.no_wait or args.shards:
        raise UsageError("--no-wait and --shards apply to a single file, not to a directory")
    started = time.monotonic()
    stored = store_directory(args.path, args.name, args.replicas)
    seconds = time.monotonic() - started
    v = stored.version
    row = {
        "name": v.name,
        "version_id": v.version_id,
        "files": {f: m.version_id for f, m in v.files.items()},
        "index": v.index_name,
        "size": sum(m.size for m in v.files.values()),
        "new_files": stored.new_files,
        "ignored": list(stored.plan.ignored),
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
    if stored.plan.ignored:
        warn(
            "not stored (only .safetensors files and their index are): "
            + ", ".join(stored.plan.ignored)
        )
    return 0


def _gather_directory(args: argparse.Namespace) -> int:
    from tasks.directory_requests import gather_directory

    if args.tensors:
        raise UsageError(
            f"{args.name} is a directory checkpoint: gather it whole, or gather --tensors from"
            f" one of its files ({args.name}/FILE)"
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
    from tasks.requests import submit_gather, wait_gather

    if is_directory(args.name):
        return _gather_directory(args)

    request = submit_gather(args.name, args.output, args.version, args.tensors)
    with _progress(args.json) as bar:
        task = bar.add_task(f"gathering {args.name}", total=request.size or 1)
        report = wait_gather(request, lambda done, _total: bar.update(task, completed=done))
    if args.json:
        emit_json(report)
    else:
        rate = report["size"] / max(report["seconds"], 1e-9)
        console.print(
            f"gathered {args.name} version {report['version_id'][:12]} -> {request.out} "
            f"({human_bytes(report['size'])} in {report['seconds']:.2f} s, "
            f"{human_bytes(rate)}/s)"
        )
        if args.tensors:
            console.print(
                f"{len(report['tensors'])} tensors, {human_bytes(report['bytes_fetched'])} read"
                " from the nodes"
                + (
                    f" (shards {report['whole_shards']} read whole: their manifest predates"
                    " per-tensor digests)"
                    if report["whole_shards"]
                    else ""
                )
            )
        for line in report["fallbacks"]:
            warn(f"fell back to another replica: {line}")
    return 0


# --- listings ------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    rows = reports.checkpoints(_md(), args.name)
    if args.json:
        emit_json(rows)
        return 0
    if not rows:
        console.print("no checkpoints stored yet; store one with `smoltorrent store PATH`.")
        return 0
    columns = ["name", "version", "state", "tensors", "size", "shards", "copies", "created"]
    table(
        args.name or "checkpoints",
        columns[1:] if args.name else columns,
        [
            (
                # The current marker goes on the first column: the name, or with one
                # name listed, the version.
                *(() if args.name else (r["name"] + (" *" if r["current"] else ""),)),
                r["version_id"][:12] + (" *" if r["current"] and args.name else ""),
                r["state"],
                r["tensors"],
                human_bytes(r["size"]),
                r["shards"],
                f"{r['min_copies']}/{r['replicas']}" + (" !" if r["under_replicated"] else ""),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_at"])),
            )
            for r in rows
        ],
    )
    console.print("* current version   ! under-replicated")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    h = reports.header(_md(), args.name, args.version)
    if not args.tensors:
        del h["tensors"]
    if args.json:
        emit_json(h)
        return 0
    console.print(
        f"{h['name']} version {h['version_id'][:12]} ({h['state']}"
        + (", current" if h["current"] else "")
        + f"): {h['tensor_count']} tensors, {h['parameters']:,} parameters, "
        f"{human_bytes(h['size'])} in {h['shards']} shards (header {h['header_bytes']} B)"
    )
    console.print("dtypes: " + ", ".join(f"{d} x{n}" for d, n in h["dtypes"].items()))
    for key, value in sorted(h["metadata"].items()):
        console.print(f"metadata {key}: {value}")
    if args.tensors:
        table(
            "tensors",
            ["name", "dtype", "shape", "size", "shard"],
            [
                (
                    t["name"],
                    t["dtype"],
                    "x".join(map(str, t["shape"])) or "()",
                    human_bytes(t["bytes"]),
                    t["shard"],
                )
                for t in h["tensors"]
            ],  # fmt: skip
        )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    s = reports.status(_md(), config.cluster_key())
    if args.json:
        emit_json(s)
        return 0
    if not s["nodes"]:
        console.print(
            "no storage nodes registered yet: run `smoltorrent serve --data-dir DIR` on each"
            " storage node, then register them here with `smoltorrent nodes add HOST`"
        )
        return 0
    now = time.time()
    table(
        "nodes",
        ["id", "address", "state", "last seen", "free", "blobs", "last scrub", "bad copies"],
        [
            (
                n["node_id"][:12],
                n["address"],
                _NODE_STATE[n["state"]],
                "now" if n["up"] else _ago(n["last_seen"], now),
                human_bytes(n["free_bytes"]) if n["up"] else "-",
                n["blobs"] if n["up"] else "-",
                ("running, " if n["scrubbing"] else "") + _ago(n["last_scrub"], now),
                f"{n['bad_copies_found']} found, {n['quarantined']} held"
                if n["bad_copies_found"] or n["quarantined"]
                else "0",
            )
            for n in s["nodes"]
        ],
    )
    up = sum(n["up"] for n in s["nodes"])
    dead = sum(n["state"] == "dead" for n in s["nodes"])
    console.print(
        f"{up}/{len(s['nodes'])} nodes up"
        + (f", {dead} dead (their shards are copied to the others)" if dead else "")
    )
    if s["under_replicated"]:
        table(
            "under-replicated shards",
            ["name", "version", "shard", "live copies"],
            [
                (u["name"], u["version_id"][:12], u["shard"], f"{u['live_copies']}/{u['replicas']}")
                for u in s["under_replicated"]
            ],
        )
    else:
        console.print("every shard of every committed version has all its live copies")
    copies = [r for r in s["repairs_in_flight"] if r["target"] != "trim"]
    if copies:
        console.print(
            f"{len(copies)} repair copies in flight: "
            + ", ".join(
                f"{r['digest'][:12]} of {'/'.join(r['names']) or '?'}"
                f" ({r['source'][:8]} -> {r['target'][:8]})"
                for r in copies
            )
        )
    if s["repairs_waiting"]:
        table(
            "repairs waiting out a backoff (their copy failed)",
            ["blob", "checkpoints", "target", "failures", "until", "last error"],
            [
                (
                    w["digest"][:12],
                    ", ".join(w["names"]),
                    w["target"][:8],
                    w["failures"],
                    time.strftime("%H:%M:%S", time.localtime(w["until"])),
                    w["error"],
                )
                for w in s["repairs_waiting"]
            ],
        )
    if s["unrepairable"]:
        table(
            "cannot repair now (retried every repair sweep)",
            ["blob", "copies", "checkpoints", "why"],
            [
                (
                    u["digest"][:12],
                    f"{u['copies']}/{u['replicas']}",
                    ", ".join(u["names"]),
                    u["reason"],
                )
                for u in s["unrepairable"]
            ],
        )
    if s["pending"]:
        console.print(
            f"{len(s['pending'])} version(s) pending: " + ", ".join(p["name"] for p in s["pending"])
        )
    console.print(
        f"dead letters: {s['dead_letters']}"
        + (" (see `smoltorrent dlq ls`)" if s["dead_letters"] else "")
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from coordinator.state.verify import verify_now

    crosscheck = None
    if not args.name:
        # The whole cluster: the crosscheck first, so copies gone from a node leave the
        # placement (and are repaired below), unknown ones are recorded, orphans past
        # their grace collected and manifests of removed versions deleted.
        from beat.crosscheck import run_pass

        crosscheck = dict(run_pass())
    r = verify_now(
        _md(),
        config.cluster_key(),
        dead_after=config.dead_after(),
        per_node=config.repairs_per_node(),
        name=args.name,
    )
    if crosscheck is not None:
        r["crosscheck"] = crosscheck
    if args.json:
        emit_json(r)
        return 1 if r["under_replicated"] else 0
    if crosscheck:
        console.print(
            "crosscheck: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in crosscheck.items())
        )
    console.print(
        f"checked {r['copies_checked']} copies of {r['blobs']} blobs on"
        f" {len(r['nodes_checked'])} nodes"
        + (f" ({len(r['nodes_unreachable'])} did not answer)" if r["nodes_unreachable"] else "")
    )
    if r["bad"]:
        table(
            "bad or missing copies",
            ["blob", "node", "problem"],
            [(b["digest"][:12], b["node"][:12], b["problem"]) for b in r["bad"]],
        )
    for item in r["repaired"]:
        console.print(
            f"repaired {item['digest'][:12]}: {item['source'][:12]} -> {item['target'][:12]}"
        )
    for item in r["failed"]:
        warn(f"could not repair {item['digest'][:12]} onto {item['target'][:12]}: {item['error']}")
    for item in r["discarded"]:
        console.print(f"discarded the bad copy of {item['digest'][:12]} on {item['node'][:12]}")
    for u in r["unrepairable"]:
        warn(
            f"{u['digest'][:12]} ({', '.join(u['names'])}): {u['copies']}/{u['replicas']}"
            f" copies, {u['reason']}"
        )
    if r["under_replicated"]:
        console.print(
            f"{len(r['under_replicated'])} blobs have fewer verified copies than they need"
            + (" (nodes that did not answer could not be checked)" * bool(r["nodes_unreachable"]))
        )
        return 1
    console.print("every blob has all its copies, verified")
    return 0


# down: missed its latest probe, not yet dead; dead: silent past SMOLTORRENT_DEAD_AFTER_S
_NODE_STATE = {"up": "up", "down": "down", "dead": "DEAD"}


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    seconds = max(0.0, now - t)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def cmd_rm(args: argparse.Namespace) -> int:
    from tasks.directory_requests import directory_checkpoints, forget_directory, is_directory

    md = _md()
    directory = is_directory(args.name)
    if directory:
        if args.version:
            raise UsageError(
                f"{args.name} is a directory checkpoint: remove it whole, or one version of"
                f" one of its files (`smoltorrent rm {args.name}/FILE --version V`)"
            )
        # Every version of every file it ever held, and its records.
        vkeys = [v for n in directory_checkpoints(args.name) for v in md.versions(n)]
    elif args.version:
        vkeys = [md.resolve(args.name, args.version)]
    else:
        vkeys = md.versions(args.name)
        if not vkeys:
            raise NotFoundError(f"no checkpoint named {args.name}; see `smoltorrent ls`.")
    _require_worker()
    from tasks.remove import remove

    results = [
        remove.apply_async(args=(v,), queue=config.CONTROL_QUEUE, argsrepr=args.name).get()
        for v in vkeys
    ]
    if directory:
        forget_directory(args.name)  # last: until here a gather still finds what is left
    if args.json:
        emit_json(results)
    else:
        deleted = sum(r["blobs_deleted"] for r in results)
        console.print(
            f"removed {len(results)} version(s) of {args.name}; {deleted} blob copies deleted"
        )
        for r in results:
            for line in r.get("left_behind", []):
                warn(f"left behind (collected later): {line}")
    return 0


def cmd_redis(args: argparse.Namespace) -> int:
    # Not through _md(): asking about the embedded Redis must not start it.
    from coordinator.state.embedded_redis import redis_status, stop_redis

    if args.redis_command == "stop":
        stopped = stop_redis()
        console.print(
            "stopped the embedded Redis; its data stays for the next start"
            if stopped
            else "the embedded Redis was not running"
        )
        return 0
    status = redis_status()
    if args.json:
        emit_json(status)
    elif not status["embedded"]:
        console.print(f"using the Redis at {status['url']} (SMOLTORRENT_REDIS_URL)")
    elif status["running"]:
        console.print(
            f"embedded Redis running: pid {status['pid']}, {status['url']}, data in {status['dir']}"
        )
    else:
        console.print(
            f"embedded Redis not running (data in {status['dir']}); the next command starts it"
        )
    return 0


def cmd_dlq(args: argparse.Namespace) -> int:
    md = _md()
    if args.dlq_command == "ls":
        records = md.dead_letters()
        if args.json:
            emit_json(records)
        elif not records:
            console.print("no dead letters")
        else:
            table(
                "dead letters",
                ["task id", "task", "checkpoint", "shard", "node", "error"],
                [
                    (
                        r["task_id"],
                        r["task"],
                        r.get("checkpoint") or "-",
                        "-" if r.get("shard") is None else r["shard"],
                        (r.get("node") or "-")[:12],
                        r["error"],  # whole: a terminal folds it, a pipe keeps it
                    )
                    for r in records
                ],
            )
        return 0
    from tasks.dead_letters import replay

    if args.all == bool(args.task_id):
        raise UsageError(
            "give one dead letter's task id or --all (not both): `smoltorrent dlq ls` lists them"
        )
    ids = [r["task_id"] for r in md.dead_letters()] if args.all else [args.task_id]
    for task_id in ids:
        replay(task_id)
    if args.json:
        emit_json({"replayed": ids})
    else:
        console.print(f"replayed {len(ids)} dead letter(s)")
    return 0


def cmd_rebuild(args: argparse.Namespace) -> int:
    from coordinator.state.rebuild import rebuild_metadata

    md = _md()
    addresses = (
        _addresses(args.addresses)
        if args.addresses
        else [rec.address for rec in md.nodes().values()]
    )
    if not addresses:
        raise SmoltorrentError(
            "no nodes to read: give their addresses, `smoltorrent rebuild HOST:PORT ...`"
        )
    summary = rebuild_metadata(md, addresses, config.cluster_key())
    if args.json:
        emit_json(summary)
    else:
        console.print(
            f"rebuilt from {summary['nodes_read']} node(s): "
            f"{summary['versions']} versions of {summary['names']} checkpoints, "
            f"{summary['placements']} blob copies"
        )
        for line in summary["unreachable"]:
            warn(f"not read: {line}")
        if not summary["nodes_read"]:
            error("no node could be read, so nothing was rebuilt; check the addresses")
    return 0 if summary["nodes_read"] else 1


def cmd_demo(args: argparse.Namespace, run_command) -> int:
    from coordinator.local.demo import run_demo

    report = run_demo(
        run_command,
        checkpoint=args.checkpoint,
        size_mb=args.size_mb,
        keep=args.keep,
        quiet=args.json,
        say=(lambda _: None) if args.json else console.print,
    )
    if args.json:
        emit_json(report)
    else:
        table(
            "demo report",
            ["step", "seconds"],
            [(k, f"{v:.2f}") for k, v in report["seconds"].items()],
        )
        console.print(
            f"store {report['store_mb_s']} MB/s, gather (one node dead) "
            f"{report['gather_mb_s']} MB/s"
        )
        if report["byte_identical"]:
            console.print(
                "SHA-256 identical: the gathered file is the stored checkpoint, byte for byte.",
                style="bold green",
            )
        else:
            console.print("SHA-256 differs!", style="bold red")
    return 0 if report["byte_identical"] else 1


def cmd_up(args: argparse.Namespace) -> int:
    from coordinator.local.stack import Stack, run_up

    if args.watch and not os.path.isdir(args.watch):
        raise UsageError(f"--watch {args.watch}: no such directory")
    stack = Stack(
        nodes=args.nodes,
        watch=os.path.abspath(args.watch) if args.watch else None,
        name_prefix=args.name_prefix,
        flower_port=args.flower_port if args.flower else None,
        metrics=args.metrics,
        say=lambda line: console.print(f"up: {line}", highlight=False),
    )
    return run_up(stack)


# --- watch ---------------------------------------------------------------------------


def _store_watched_directory(path: str, name: str, replicas: int) -> None:
    import logging

    from tasks.directory_requests import store_directory

    log = logging.getLogger("smoltorrent.watch")
    with _watched_directory_lock(name):  # one store of a directory at a time, in order
        try:
            stored = store_directory(path, name, replicas)
        except SmoltorrentError as exc:
            log.warning(
                "storing %s as %s failed: %s; it is tried again when it changes", path, name, exc
            )
            return
    log.info(
        "event=stored-directory name=%s version=%s new_files=%d",
        name,
        stored.version.version_id,
        len(stored.new_files),
    )


_watched_directory_locks: dict[str, threading.Lock] = {}


def _watched_directory_lock(name: str) -> threading.Lock:
    return _watched_directory_locks.setdefault(name, threading.Lock())


def cmd_watch(args: argparse.Namespace) -> int:
    import logging
    import signal

    import redis
    from kombu.exceptions import OperationalError

    from coordinator.watcher import Watcher, stored_identities_from
    from smoltorrent.errors import MetadataError
    from tasks.requests import submit_store

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.replicas < 1:
        raise SmoltorrentError("--replicas must be at least 1")
    md = _md()

    def submit(path: str, name: str) -> str:
        try:
            return submit_store(path, name, args.replicas).task_id
        except (redis.RedisError, OperationalError) as exc:
            raise MetadataError(
                f"Redis is not answering ({exc}); {name} stays pending and is tried again."
            ) from exc

    def identities(name: str):
        try:
            return stored_identities_from(md)(name)
        except redis.RedisError as exc:
            raise MetadataError(f"Redis is not answering ({exc})") from exc

    def submit_directory(path: str, name: str) -> None:
        # A directory version is recorded once every file is committed: wait for that on
        # a thread of its own so the watcher goes on looking at other files meanwhile.
        threading.Thread(
            target=_store_watched_directory, args=(path, name, args.replicas), daemon=True
        ).start()

    watcher = Watcher(
        args.directory,
        submit,
        name_prefix=args.name_prefix,
        stored_identities=identities,
        submit_directory=submit_directory,
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: watcher.stop())
    watcher.run()
    return 0
