"""The shard server's command-line options, shared by `python -m worker_server` and
`smoltorrent serve` so the two can never drift apart."""

from __future__ import annotations

import argparse

from smoltorrent import defaults


def tcp_port(text: str) -> int:
    """argparse type: a TCP port, 0 meaning "any free one"."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535, or 0: any)")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--port",
        type=tcp_port,
        default=defaults.DEFAULT_PORT,
        help=f"TCP port (default {defaults.DEFAULT_PORT}; 0 picks a free one)",
    )
    key = parser.add_mutually_exclusive_group()
    key.add_argument(
        "--key-file",
        metavar="PATH",
        help="the cluster key file `smoltorrent init` wrote, copied to this machine (default:"
        " the file SMOLTORRENT_CLUSTER_KEY_FILE names; with no key the node listens on"
        " loopback only)",
    )
    key.add_argument(
        "--cluster-key",
        help="the cluster key itself (visible to other users in the process list: prefer"
        " --key-file; default: the SMOLTORRENT_CLUSTER_KEY environment variable)",
    )
    parser.add_argument(
        "--socket-timeout",
        type=float,
        help="seconds without progress before a peer counts as stalled (default: the"
        f" SMOLTORRENT_SOCKET_TIMEOUT_S environment variable, else {defaults.SOCKET_TIMEOUT_S})",
    )
    parser.add_argument(
        "--metrics-port",
        type=tcp_port,
        help="serve Prometheus /metrics on this TCP port (default: the"
        " SMOLTORRENT_METRICS_PORT environment variable, else no metrics)",
    )
    parser.add_argument(
        "--metrics-host",
        help="address /metrics listens on (default: the SMOLTORRENT_METRICS_HOST environment"
        " variable, else 127.0.0.1: metrics have no login; give 0.0.0.0 or this node's"
        " address for a Prometheus on another machine)",
    )
    parser.add_argument(
        "--no-mdns",
        action="store_true",
        help="do not advertise this node over multicast DNS (_smoltorrent._tcp.local.; on by"
        " default when the node listens beyond loopback)",
    )


def serve(args: argparse.Namespace) -> int:
    """Run the shard server the parsed options describe, in the foreground."""
    # Imported here, not at the top: every other CLI command parses these options too,
    # and the server (with http.server for its metrics) costs each of them ~75 ms.
    from worker_server.server import run_from_args

    return run_from_args(
        args.data_dir,
        args.host,
        args.port,
        args.cluster_key,
        key_file=args.key_file,
        socket_timeout=args.socket_timeout,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        insecure=args.insecure,
        mdns=not args.no_mdns,
    )
