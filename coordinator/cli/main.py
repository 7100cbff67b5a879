"""The smoltorrent command line.

Exit codes: 0 success, 1 failure (the message says what to do next),
2 usage error. Every listing takes --json.
"""

from __future__ import annotations

import argparse
import os
import sys

from coordinator.cli.output import error
from smoltorrent import defaults
from smoltorrent.errors import SmoltorrentError

EPILOG = """\
Quick start on one machine (everything local, nothing to configure):
  smoltorrent demo

A real cluster:
  on each storage node:   smoltorrent serve --data-dir /srv/smoltorrent
  on the training box:    smoltorrent nodes add pi1:7411 pi2:7411 pi3:7411 pi4:7411
                          smoltorrent worker &          # runs the transfers
                          smoltorrent store ckpt/step_100.safetensors
                          smoltorrent gather step_100.safetensors -o restored.safetensors

Environment:
  SMOLTORRENT_REDIS_URL    Redis for metadata and Celery (default: an embedded one)
  SMOLTORRENT_HOME         state directory (default ~/.smoltorrent)
  SMOLTORRENT_CLUSTER_KEY  shared secret; nodes then refuse unauthenticated peers
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smoltorrent",
        description="Keep .safetensors training checkpoints on a cluster of cheap storage "
        "nodes: sharded at tensor boundaries, replicated, verified with SHA-256, and "
        "gathered back byte-identical.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run a shard server (on each storage node)")
    s.add_argument("--data-dir", required=True, help="where blobs and manifests are kept")
    s.add_argument(
        "--host",
        help="address to listen on (default: all interfaces with a cluster key, 127.0.0.1"
        " without one)",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback without a cluster key (anyone who can reach"
        " the node can then read, write and delete its blobs)",
    )
    s.add_argument(
        "--port",
        type=int,
        default=defaults.DEFAULT_PORT,
        help=f"TCP port (default {defaults.DEFAULT_PORT}; 0 picks a free one)",
    )
    s.add_argument("--cluster-key", help="shared secret (or SMOLTORRENT_CLUSTER_KEY)")
    s.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics on this port (or SMOLTORRENT_METRICS_PORT; default off)",
    )

    n = sub.add_parser("nodes", help="register, list and remove storage nodes")
    nsub = n.add_subparsers(dest="nodes_command", required=True, metavar="ACTION")
    na = nsub.add_parser("add", help="register nodes by address (each is contacted)")
    na.add_argument("addresses", nargs="+", metavar="HOST:PORT")
    na.add_argument("--json", action="store_true")
    nl = nsub.add_parser("ls", help="list registered nodes and whether they answer")
    nl.add_argument("--json", action="store_true")
    nr = nsub.add_parser("rm", help="forget a node (by id, id prefix or address)")
    nr.add_argument("node")

    w = sub.add_parser("worker", help="run a Celery worker for this host's queues")
    w.add_argument("--concurrency", type=int, default=defaults.WORKER_CONCURRENCY)
    w.add_argument("--loglevel", default="WARNING")
    w.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics on this port (or SMOLTORRENT_METRICS_PORT; default off)",
    )

    st = sub.add_parser("store", help="store a checkpoint (waits for the commit)")
    st.add_argument("path", help="a .safetensors file on this machine")
    st.add_argument("--name", help="checkpoint name (default: the file name)")
    st.add_argument(
        "--replicas",
        type=int,
        default=defaults.DEFAULT_REPLICAS,
        help=f"copies of each shard (default {defaults.DEFAULT_REPLICAS})",
    )
    st.add_argument("--shards", type=int, help="shard count (default: number of live nodes)")
    st.add_argument("--no-wait", action="store_true", help="return once the store is queued")
    st.add_argument("--json", action="store_true")

    g = sub.add_parser("gather", help="rebuild a checkpoint into a file")
    g.add_argument("name")
    g.add_argument("-o", "--output", required=True, help="destination file")
    g.add_argument("--version", help="a version id prefix (default: the current version)")
    g.add_argument("--json", action="store_true")

    ls = sub.add_parser("ls", help="list checkpoints and their versions")
    ls.add_argument("--json", action="store_true")

    stat = sub.add_parser("status", help="nodes, under-replicated shards, dead letters")
    stat.add_argument("--json", action="store_true")

    rm = sub.add_parser("rm", help="remove a checkpoint (all versions) or one version")
    rm.add_argument("name")
    rm.add_argument("--version", help="a version id prefix")
    rm.add_argument("--json", action="store_true")

    d = sub.add_parser("dlq", help="list and replay dead letters (tasks that failed for good)")
    dsub = d.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    dl = dsub.add_parser("ls", help="list dead letters")
    dl.add_argument("--json", action="store_true")
    dr = dsub.add_parser("replay", help="send dead tasks again once the cause is fixed")
    dr.add_argument("task_id", nargs="?")
    dr.add_argument("--all", action="store_true")

    rb = sub.add_parser("rebuild", help="rebuild the metadata from the manifests on the nodes")
    rb.add_argument(
        "addresses",
        nargs="*",
        metavar="HOST:PORT",
        help="nodes to read (default: the registered ones)",
    )
    rb.add_argument("--json", action="store_true")

    wa = sub.add_parser(
        "watch",
        help="store every checkpoint written under a directory, once it is complete",
        description="Watch DIR (recursively) and store every new or rewritten *.safetensors "
        "as the name of its path relative to DIR, once the writer has finished it. Files "
        "still being written wait in a pending list; identical content stores nothing; "
        "what changed while the watcher was down is stored at start. Runs until SIGTERM "
        "or Ctrl-C; the transfers run on this host's worker (`smoltorrent worker`).",
    )
    wa.add_argument("directory", metavar="DIR")
    wa.add_argument("--name-prefix", default="", help="put names under P/ (e.g. the run name)")
    wa.add_argument(
        "--replicas",
        type=int,
        default=defaults.DEFAULT_REPLICAS,
        help=f"copies of each shard (default {defaults.DEFAULT_REPLICAS})",
    )

    f = sub.add_parser("flower", help="run Flower (Celery monitoring) on the same broker")
    f.add_argument("--port", type=int, default=defaults.FLOWER_PORT)
    f.add_argument(
        "--address",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: Flower has no login and can revoke"
        " tasks; put it behind a proxy with authentication before widening this)",
    )

    demo = sub.add_parser("demo", help="a complete local cluster, end to end, then cleaned up")
    demo.add_argument("--checkpoint", help="a .safetensors file to use (default: a built one)")
    demo.add_argument(
        "--size-mb",
        type=int,
        default=defaults.DEMO_CHECKPOINT_MB,
        help="size of the built checkpoint",
    )
    demo.add_argument("--keep", action="store_true", help="leave the cluster's files behind")
    demo.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return dispatch(args)
    except SmoltorrentError as exc:
        error(str(exc))
        return 1
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from worker_server.server import run_from_args

        return run_from_args(
            args.data_dir,
            args.host,
            args.port,
            args.cluster_key,
            metrics_port=args.metrics_port,
            insecure=args.insecure,
        )
    if args.command == "demo":
        from coordinator.cli.commands import cmd_demo

        # The demo drives this same entry point; passing it in keeps local/ free of cli/.
        return cmd_demo(args, run_command=main)
    from coordinator.cli import commands

    return getattr(commands, f"cmd_{args.command}")(args)
