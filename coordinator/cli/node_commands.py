"""`init`, `nodes add|ls|rm` and `discover`: the cluster key, and the storage nodes this
cluster knows, registered by address or found over mDNS (only those that prove the key)."""

from __future__ import annotations

import argparse
import socket
import sys

from coordinator import config
from coordinator.cli import reports
from coordinator.cli.cluster import NODE_STATE, metadata, node_addresses
from coordinator.cli.output import console, emit_json, human_bytes, table
from coordinator.dataplane.node_client import NodeAddress, NodeClient, NodeStat
from coordinator.state.nodes import local_node
from smoltorrent import defaults
from smoltorrent.cluster_key import create_key_file
from smoltorrent.errors import (
    ConfigError,
    NodeUnavailableError,
    NotFoundError,
    PeerClosedError,
    SmoltorrentError,
    UsageError,
)

REMOTE_KEY_FILE = "~/.smoltorrent/cluster.key"  # where every other machine keeps the key

INIT_STEPS = """\
wrote a new cluster key to {path} (mode 0600). Keep it secret: whoever holds it can read,
write and delete every checkpoint. Every machine below needs this one file and one Redis.

Redis: {redis}

1. Copy the key file to each storage node and each other training or reading machine:
     ssh HOST 'mkdir -p ~/.smoltorrent && umask 077 && cat > {remote}' < {path}

2. On each storage node (it listens on every interface, port {port}):
     smoltorrent serve --key-file {remote} --data-dir /srv/smoltorrent

3. On this machine (the training box):
     export SMOLTORRENT_REDIS_URL={url}
     smoltorrent nodes add HOST1 HOST2 HOST3 HOST4
     smoltorrent worker &
     smoltorrent beat &
     smoltorrent store checkpoints/step_100.safetensors
   (or SMOLTORRENT_DISCOVER=1 smoltorrent worker: it registers, over mDNS, every node
   that proves this key)

4. On each other training or reading machine (the key is read from {remote};
   elsewhere set SMOLTORRENT_CLUSTER_KEY_FILE=PATH):
     export SMOLTORRENT_REDIS_URL={url}
     smoltorrent worker &                                      # a training machine
     smoltorrent gather step_100.safetensors -o /data/step_100.safetensors  # any reader
"""


def cmd_init(args: argparse.Namespace) -> int:
    path = config.cluster_key_file()
    create_key_file(path, force=args.force)
    url = config.redis_url_from_env()
    if url is not None:
        redis, shown = f"{config.shown_url(url)} (SMOLTORRENT_REDIS_URL)", config.shown_url(url)
    else:
        redis = (
            "none set: the embedded one listens on loopback only. Run a Redis the other"
            " machines reach\n  (Debian: apt install redis-server; in redis.conf set bind,"
            " requirepass, appendonly yes,\n  maxmemory-policy noeviction) and use its URL below."
        )
        shown = f"redis://:<password>@{socket.gethostname()}:6379/0"
    sys.stdout.write(
        INIT_STEPS.format(
            path=path,
            remote=REMOTE_KEY_FILE,
            redis=redis,
            url=shown,
            port=defaults.DEFAULT_PORT,
        )
    )
    return 0


def _stat(address: NodeAddress, timeout: float) -> NodeStat:
    """The node's answer to `stat`; one that does not come within `timeout` is said with
    the flag that gives it longer (the client's own words name no setting)."""
    try:
        return NodeClient(address, cluster_key=config.cluster_key(), timeout=timeout).stat()
    except NodeUnavailableError as exc:
        if not isinstance(exc.__cause__, TimeoutError | PeerClosedError):
            raise
        raise NodeUnavailableError(
            f"node {address} did not answer within {timeout:g} s (`nodes add --timeout`):"
            " check that `smoltorrent serve` runs there, listens beyond loopback (a cluster"
            f" key or --insecure) and that a firewall lets port {address.port} through; on a"
            f" slow link give it longer, e.g. `smoltorrent nodes add {address} --timeout"
            f" {4 * timeout:g}`"
        ) from exc


def cmd_nodes(args: argparse.Namespace) -> int:
    md = metadata()
    if args.nodes_command == "add":
        rows = []
        found = [
            (address, _stat(address, args.timeout))
            for address in node_addresses(args.addresses, defaults.DEFAULT_PORT)
        ]
        for address, stat in found:  # every address checked before any is registered
            md.nodes.refuse_second_id(address, stat.node_id)
        for address, stat in found:
            md.nodes.add_node(stat.node_id, address, local_node(address, stat, config.host_id()))
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
    from coordinator.discovery import NO_KEY, browse, register

    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: give a number of seconds above 0")
    if args.register and config.cluster_key() is None:
        raise ConfigError(f"discover --register: {NO_KEY}")
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
