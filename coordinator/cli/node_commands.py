"""`nodes add|ls|rm` and `discover`: the storage nodes this cluster knows, registered by
address or found over mDNS."""

from __future__ import annotations

import argparse

from coordinator import config
from coordinator.cli import reports
from coordinator.cli.cluster import NODE_STATE, metadata, node_addresses
from coordinator.cli.output import console, emit_json, human_bytes, table
from coordinator.dataplane.node_client import NodeClient
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError, SmoltorrentError, UsageError


def cmd_nodes(args: argparse.Namespace) -> int:
    md = metadata()
    if args.nodes_command == "add":
        rows = []
        for address in node_addresses(args.addresses, defaults.DEFAULT_PORT):
            stat = NodeClient(
                address, cluster_key=config.cluster_key(), timeout=defaults.CONNECT_TIMEOUT_S
            ).stat()
            md.nodes.add_node(stat.node_id, address)
            md.nodes.mark_alive(stat.node_id, stat.__dict__)
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
                        NODE_STATE[n["state"]],
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
        for nid, rec in md.nodes.nodes().items()
        if nid.startswith(args.node) or str(rec.address) == args.node
    ]
    if len(matches) != 1:
        raise NotFoundError(
            f"{'no' if not matches else 'several'} registered nodes match "
            f"'{args.node}'; see `smoltorrent nodes ls`."
        )
    md.nodes.remove_node(matches[0])
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
    md = metadata()
    known = md.nodes.nodes()
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
