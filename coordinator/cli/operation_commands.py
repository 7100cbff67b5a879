"""The operator's commands: `verify` (scrub and repair now), `rm`, `dlq ls|replay`,
`rebuild` (the metadata from the nodes' manifests) and `redis status|stop`."""

from __future__ import annotations

import argparse
import sys
import time

from coordinator import config
from coordinator.cli.cluster import metadata, node_addresses
from coordinator.cli.output import console, emit_json, error, numbers, table, warn
from coordinator.plan.manifest import LABEL
from coordinator.state import redis_keys as K
from smoltorrent.errors import NotFoundError, SmoltorrentError, UsageError


def _require_worker() -> None:
    from tasks.requests import require_worker

    require_worker()


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
        metadata(),
        config.cluster_key(),
        dead_after=config.dead_after(),
        per_node=config.repairs_per_node(),
        rate=config.repair_bps(),
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


def cmd_rm(args: argparse.Namespace) -> int:
    from tasks.directory_requests import directory_checkpoints, forget_directory, is_directory

    md = metadata()
    directory = is_directory(args.name)
    if directory:
        if args.version:
            raise UsageError(
                f"{args.name} is a directory checkpoint: remove it whole, or one version of"
                f" one of its files (`smoltorrent rm {args.name}/FILE --version V`)"
            )
        # Every version of every file it ever held, and its records.
        vkeys = [v for n in directory_checkpoints(args.name) for v in md.versions.versions(n)]
    elif args.version:
        vkeys = [md.versions.resolve(args.name, args.version)]
    else:
        vkeys = md.versions.versions(args.name)
        if not vkeys:
            raise NotFoundError(f"no checkpoint named {args.name}; see `smoltorrent ls`.")
    pinned = [v for v, (pin, _) in md.versions.labels(vkeys).items() if pin]
    unpin = "; ".join(
        f"`smoltorrent unpin {r['name']} {r['version_id'][:12]}`" for r in _version_rows(md, pinned)
    )
    if args.dry_run:  # a dry run lists what would go, and what stops it
        return _would_remove(md, args, vkeys, unpin)
    if pinned:
        raise SmoltorrentError(
            f"{args.name}: {len(pinned)} of its version(s) pinned, so nothing was removed;"
            f" unpin first: {unpin}"
        )
    if not args.version and not args.yes and not _confirmed(md, args.name, vkeys):
        console.print("nothing removed")
        return 1
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


def _version_rows(md, vkeys: list[str]) -> list[dict]:
    with md.r.pipeline(transaction=False) as p:
        for v in vkeys:
            p.hmget(K.VERSION.format(vkey=v), ["name", "version_id", "state", "created_at"])
        found = p.execute()
    return [
        {"name": n, "version_id": i, "state": s, "created_at": float(t or 0)}
        for n, i, s, t in found
        if i is not None
    ]


def _would_remove(md, args: argparse.Namespace, vkeys: list[str], unpin: str) -> int:
    """What `rm` would remove; where a version is pinned, that rm refuses until it is
    unpinned, and how."""
    rows = _version_rows(md, vkeys)
    if args.json:
        emit_json({"would_remove": rows, "refused_until": unpin or None})
        return 0
    table(
        f"rm {args.name} would remove",
        ["name", "version", "state", "created"],
        [
            (
                r["name"],
                r["version_id"][:12],
                r["state"],
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_at"])),
            )
            for r in rows
        ],  # fmt: skip
    )
    console.print(f"{len(rows)} version(s); nothing removed (--dry-run)")
    if unpin:
        warn(f"rm refuses while a version is pinned: unpin first: {unpin}")
    return 0


def _confirmed(md, name: str, vkeys: list[str]) -> bool:
    """Every version of `name` goes: ask on a terminal. A script (no terminal to answer on)
    is refused: it says --yes, so a mistyped loop never empties a name unasked."""
    if not sys.stdin.isatty():
        raise UsageError(
            f"`rm {name}` removes every version of it ({len(vkeys)}): add --yes to do so"
            " without a question, --dry-run to list them, or --version V to remove one"
        )
    rows = _version_rows(md, vkeys)
    ids = ", ".join(r["version_id"][:12] for r in rows[-5:])
    more = f"{len(rows) - 5} more and " if len(rows) > 5 else ""
    sys.stderr.write(
        f"remove {len(rows)} versions of {name} ({more}{ids}) and the blobs only they use? [y/N] "
    )
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _committed(md, name: str, version: str | None) -> tuple[str, str]:
    """(vkey, version id) of NAME's VERSION (a version id prefix) or current version."""
    vkey = md.versions.resolve(name, version)
    return vkey, md.versions.version(vkey)["version_id"]


def _said(args: argparse.Namespace, answer: dict, line: str) -> int:
    if args.json:
        emit_json(answer)
    else:
        console.print(line)
    return 0


def _on_the_nodes(md, vkeys: list[str], what: str) -> None:
    """Pins and labels live on the nodes too (in their manifest copies), so a rebuild
    brings them back; said when no node took them."""
    from coordinator.state import marks

    if not marks.publish(md, vkeys, config.cluster_key()):
        warn(
            f"{what} is recorded in Redis, but no node holding the version answered to keep"
            " it too: a rebuild from the nodes now would not bring it back"
        )


def cmd_pin(args: argparse.Namespace) -> int:
    md = metadata()
    vkey, vid = _committed(md, args.name, args.version)
    state = md.versions.pin(vkey)
    if state != "committed":
        raise SmoltorrentError(f"{args.name} {vid[:12]} is {state}: only a committed one is pinned")
    _on_the_nodes(md, [vkey], f"the pin of {args.name} {vid[:12]}")
    return _said(
        args,
        {"name": args.name, "version_id": vid, "pinned": True},
        f"pinned {args.name} {vid[:12]}: retention keeps it until `smoltorrent unpin`",
    )


def cmd_unpin(args: argparse.Namespace) -> int:
    md = metadata()
    vkey, vid = _committed(md, args.name, args.version)
    was = md.versions.unpin(vkey)
    if was:
        _on_the_nodes(md, [vkey], f"the unpin of {args.name} {vid[:12]}")
    return _said(
        args,
        {"name": args.name, "version_id": vid, "pinned": False, "was_pinned": was},
        f"unpinned {args.name} {vid[:12]}" if was else f"{args.name} {vid[:12]} was not pinned",
    )


def cmd_tag(args: argparse.Namespace) -> int:
    if not LABEL.fullmatch(args.label):
        raise UsageError(
            f"{args.label!r} is not a label: letters, digits, '.', '_' and '-', up to 64,"
            " starting with a letter or digit"
        )
    md = metadata()
    vkey, vid = _committed(md, args.name, args.version)
    answer = {"name": args.name, "version_id": vid, "label": args.label}
    if args.rm:
        if not md.versions.untag(vkey, args.label):
            raise NotFoundError(f"{args.name} {vid[:12]} is not tagged {args.label!r}")
        _on_the_nodes(md, [vkey], f"the label {args.label} of {args.name} {vid[:12]}")
        return _said(args, answer, f"{args.name} {vid[:12]} is no longer {args.label}")
    had = [v for v, (_, labels) in md.versions.labels(md.versions.versions(args.name)).items()
           if args.label in labels and v != vkey]  # fmt: skip
    state = md.versions.tag(vkey, args.name, args.label)
    if state != "committed":
        raise SmoltorrentError(f"{args.name} {vid[:12]} is {state}: only a committed one is tagged")
    # The version it was taken from first: its copies then carry the older marks number.
    _on_the_nodes(md, [*had, vkey], f"the label {args.label} of {args.name} {vid[:12]}")
    return _said(
        args, answer, f"tagged {args.name} {vid[:12]} {args.label}: {args.name}@{args.label}"
    )


def cmd_retain(args: argparse.Namespace) -> int:
    from coordinator.state import retention

    md = metadata()
    if args.prefix is None:
        if args.keep or args.off or args.dry_run:
            raise UsageError("give the PREFIX/ the rule is for")
        found = retention.rules(md)
        if args.json:
            emit_json(found)
        elif not found:
            console.print(
                "no retention rules; `smoltorrent retain PREFIX/ --keep K` keeps the K newest"
                " under PREFIX/"
            )
        else:
            table("retention rules", ["prefix", "keep"], sorted(found.items()))
        return 0
    retention.check_prefix(args.prefix)
    if args.off:
        dropped = retention.drop_rule(md, args.prefix)
        return _said(
            args,
            {"prefix": args.prefix, "keep": None, "dropped": dropped},
            f"no retention rule on {args.prefix} now" + ("" if dropped else " (there was none)"),
        )
    keep = args.keep or retention.rules(md).get(args.prefix)
    if keep is None:
        raise UsageError(f"no rule on {args.prefix} yet: give --keep K")
    if args.dry_run:
        names, _ = retention.plan(md, args.prefix, keep)
        if args.json:
            emit_json({"prefix": args.prefix, "keep": keep, "would_remove": names})
        else:
            for name in names:
                console.print(name)
            console.print(
                f"{len(names)} name(s) under {args.prefix} past the {keep} newest"
                " (pinned versions stay); nothing removed (--dry-run)"
            )
        return 0
    retention.set_rule(md, args.prefix, keep)
    return _said(
        args,
        {"prefix": args.prefix, "keep": keep},
        f"retention keeps the {keep} newest under {args.prefix} (applied by the retention"
        " sweep of `smoltorrent beat`; pinned versions stay)",
    )


def cmd_redis(args: argparse.Namespace) -> int:
    # Not through metadata(): asking about the embedded Redis must not start it.
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
    md = metadata()
    if args.dlq_command == "ls":
        records = md.dead_letters.dead_letters()
        if args.json:
            emit_json(records)
        elif not records:
            console.print("no dead letters")
        else:
            table(
                "dead letters",
                ["task id", "task", "checkpoint", "shards", "node", "error"],
                [
                    (
                        r["task_id"],
                        r["task"],
                        r.get("checkpoint") or "-",
                        # A chain task carries a batch of chunks: every one of them.
                        numbers(r["shards"])
                        if r.get("shards")
                        else "-"
                        if r.get("shard") is None
                        else r["shard"],
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
    ids = [r["task_id"] for r in md.dead_letters.dead_letters()] if args.all else [args.task_id]
    for task_id in ids:
        replay(task_id)
    if args.json:
        emit_json({"replayed": ids})
    else:
        console.print(f"replayed {len(ids)} dead letter(s)")
    return 0


def cmd_rebuild(args: argparse.Namespace) -> int:
    from coordinator.state.rebuild import rebuild_metadata

    md = metadata()
    addresses = (
        node_addresses(args.addresses)
        if args.addresses
        else [rec.address for rec in md.nodes.nodes().values()]
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
            + (f"; {summary['skipped']} manifest(s) skipped" if summary["skipped"] else "")
        )
        for line in summary["unreachable"]:
            warn(f"not read: {line}")
        if not summary["nodes_read"]:
            error("no node could be read, so nothing was rebuilt; check the addresses")
    return 0 if summary["nodes_read"] else 1
