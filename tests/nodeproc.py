"""Shard servers as real processes on loopback, for any test package.

node = start_node(tmp_path / "node1", cluster_key=b"secret")
node.client().ping()
node.kill()      # SIGKILL, like a power cut
node.restart()   # same data dir, same port
node.stop()      # SIGTERM, clean exit
"""

from __future__ import annotations

import os
import urllib.request

from coordinator.local.cluster import NodeProcess

__all__ = ["NodeProcess", "bytes_sent", "node_metric", "start_node"]


def start_node(
    data_dir: str | os.PathLike[str],
    cluster_key: bytes | None = None,
    *,
    socket_timeout: float | None = None,
) -> NodeProcess:
    """Start a shard server process serving data_dir on a free loopback port."""
    return NodeProcess(data_dir, cluster_key, socket_timeout=socket_timeout).start()


def node_metric(node: NodeProcess, name: str) -> float:
    """One sample of a node's /metrics (started with SMOLTORRENT_METRICS_PORT set)."""
    port = (node.data_dir / "metrics_port").read_text().strip()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    # A sample line: the name, its labels ({node="..."}) if any, the value.
    line = next(x for x in text.splitlines() if x.startswith((name + " ", name + "{")))
    return float(line.split()[-1])


def bytes_sent(nodes: list[NodeProcess]) -> float:
    """Blob bytes the nodes have sent (reads and node-to-node pushes), summed."""
    return sum(node_metric(n, "smoltorrent_node_bytes_sent_total") for n in nodes)
