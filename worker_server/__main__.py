"""`python -m worker_server`: run one shard server in the foreground."""

from __future__ import annotations

import argparse
import sys

from smoltorrent import defaults
from worker_server.server import run_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker_server", description="Run a smoltorrent shard server."
    )
    parser.add_argument("--data-dir", required=True, help="where blobs and manifests are kept")
    parser.add_argument(
        "--host",
        help="address to listen on (IPv4; default: all interfaces with a cluster key,"
        " 127.0.0.1 without one)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback without a cluster key (anyone who can reach"
        " the node can then read, write and delete its blobs)",
    )
    parser.add_argument(
        "--port", type=int, default=defaults.DEFAULT_PORT, help="TCP port; 0 picks a free one"
    )
    parser.add_argument(
        "--cluster-key",
        help="shared secret for every node and coordinator (default: the"
        " SMOLTORRENT_CLUSTER_KEY environment variable)",
    )
    parser.add_argument(
        "--socket-timeout",
        type=float,
        help="seconds without progress before a peer counts as stalled (default: the"
        f" SMOLTORRENT_SOCKET_TIMEOUT_S environment variable, else {defaults.SOCKET_TIMEOUT_S})",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus /metrics on this TCP port (default: the"
        " SMOLTORRENT_METRICS_PORT environment variable, else no metrics)",
    )
    args = parser.parse_args(argv)
    return run_from_args(
        args.data_dir,
        args.host,
        args.port,
        args.cluster_key,
        socket_timeout=args.socket_timeout,
        metrics_port=args.metrics_port,
        insecure=args.insecure,
    )


if __name__ == "__main__":
    sys.exit(main())
