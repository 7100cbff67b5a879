"""`ls`, `show` and `status`: what is stored and how the cluster is, read from Redis (and
node probes). None of them sends a task, so none imports Celery."""

from __future__ import annotations

import argparse
import time

from coordinator import config
from coordinator.cli import reports
from coordinator.cli.cluster import NODE_STATE, at_label, metadata
from coordinator.cli.output import console, emit_json, human_bytes, pieces, table


def cmd_ls(args: argparse.Namespace) -> int:
    rows = reports.checkpoints(metadata(), args.name)
    if args.json:
        emit_json(rows)
        return 0
    if not rows and args.name:
        console.print(f"nothing stored under {args.name}; `smoltorrent ls` lists every name.")
        return 0
    if not rows:
        console.print("no checkpoints stored yet; store one with `smoltorrent store PATH`.")
        return 0
    # "chunks": a version's pieces (a version stored with --shards: its shards)
    columns = ["name", "version", "state", "tensors", "size", "chunks", "copies", "kept"]
    columns.append("created")
    # One name's versions (not a prefix's, nor a directory checkpoint's files)
    one_name = args.name is not None and all(r["name"] == args.name for r in rows)
    if one_name:
        columns = columns[1:]
    # On a terminal the current marker goes on the first column, with a legend below; a
    # pipe gets only rows, the marker in a column of its own.
    legend = console.is_terminal
    if not legend:
        columns.insert(1 if one_name else 2, "current")

    def cells(r: dict) -> tuple:
        version = r["version_id"][:12]
        key = (version,) if one_name else (r["name"], version)
        current = "*" if r["current"] else ""
        key = (key[0] + (" *" if current else ""), *key[1:]) if legend else (*key, current)
        return (
            *key,
            r["state"],
            r["tensors"],
            human_bytes(r["size"]),
            r["shards"],
            f"{r['min_copies']}/{r['replicas']}" + (" !" if r["under_replicated"] else ""),
            ",".join(["pinned"] * r["pinned"] + [f"@{t}" for t in r["tags"]]),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_at"])),
        )

    table(
        args.name or "checkpoints",
        columns,
        [cells(r) for r in rows],
        optional=["tensors", "chunks", "created", "kept"],
    )
    if legend:
        console.print("* current version   ! under-replicated")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    args.name, args.version = at_label(args.name, args.version)
    h = reports.header(metadata(), args.name, args.version)
    if not args.tensors:
        del h["tensors"]
    if args.json:
        emit_json(h)
        return 0
    console.print(
        f"{h['name']} version {h['version_id'][:12]} ({h['state']}"
        + (", current" if h["current"] else "")
        + f"): {h['tensor_count']} tensors, {h['parameters']:,} parameters, "
        f"{human_bytes(h['size'])} in {pieces(h['shards'], h['chunked'])} "
        f"(header {h['header_bytes']} B)"
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
    s = reports.status(metadata(), config.cluster_key())
    # Non-zero when a shard has no live copy, for cron and monitoring: that data cannot be
    # read until a node holding it comes back (a shard merely short is repaired).
    code = 0 if s["summary"]["healthy"] else 1
    if args.json:
        emit_json(s)
        return code
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
                NODE_STATE[n["state"]],
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
        optional=["last scrub", "blobs", "last seen"],
    )
    up = sum(n["up"] for n in s["nodes"])
    dead = sum(n["state"] == "dead" for n in s["nodes"])
    console.print(
        f"{up}/{len(s['nodes'])} nodes up"
        + (f", {dead} dead (their chunks are copied to the others)" if dead else "")
    )
    if s["under_replicated"]:
        # One row a version, not one a chunk (a lost node leaves thousands short).
        short: dict[tuple[str, str], list[dict]] = {}
        for u in s["under_replicated"]:
            short.setdefault((u["name"], u["version_id"]), []).append(u)
        table(
            "versions short of their copies",
            ["name", "version", "chunks short", "fewest live copies"],
            [
                (
                    name,
                    version[:12],
                    len(chunks),
                    f"{min(u['live_copies'] for u in chunks)}/{chunks[0]['replicas']}",
                )
                for (name, version), chunks in short.items()
            ],
        )
    else:
        console.print("every chunk of every committed version has all its live copies")
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
    console.print(_summary_line(s["summary"], s["nodes"], now))
    return code


def _summary_line(summary: dict, nodes: list[dict], now: float) -> str:
    up = f"{summary['nodes_up']}/{summary['nodes']} nodes up"
    short = summary["under_replicated_shards"]
    if not summary["healthy"]:
        return (
            f"NOT HEALTHY: {up}, {summary['shards_without_copy']} chunk(s) with no live copy"
            " (unreadable until a node holding them comes back; start it, or see the tables"
            " above)"
        )
    if not short:
        return f"healthy: {up}, every chunk has all its live copies"
    line = f"healthy: {up}, {short} chunk(s) short of their replicas"
    if any(n["state"] == "dead" for n in nodes):
        return f"{line} (being repaired: copied from the other nodes)"
    down = [n for n in nodes if n["state"] == "down"]
    if not down:
        return f"{line} (the repair sweep copies them)"
    # Repair starts only once a node has been silent for the dead timeout: until then it
    # may be restarting, and its copies come back with it.
    after = config.dead_after()
    since = min((n["last_seen"] for n in down if n["last_seen"]), default=None)
    when = "" if since is None else f", in {max(0.0, since + after - now):.0f} s"
    return (
        f"{line}: {len(down)} node(s) down, not repaired yet; their copies come back with"
        f" them, or are copied to the others once a node has been silent"
        f" {after:.0f} s (SMOLTORRENT_DEAD_AFTER_S{when})"
    )


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    seconds = max(0.0, now - t)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"
