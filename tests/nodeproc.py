"""Shard servers as real processes on loopback, for any test package.

node = start_node(tmp_path / "node1", cluster_key=b"secret")
node.client().ping()
node.kill()      # SIGKILL, like a power cut
node.restart()   # same data dir, same port
node.stop()      # SIGTERM, clean exit
"""

from __future__ import annotations

import os

from coordinator.local.cluster import NodeProcess

__all__ = ["NodeProcess", "start_node"]


def start_node(
    data_dir: str | os.PathLike[str],
    cluster_key: bytes | None = None,
    *,
    socket_timeout: float | None = None,
) -> NodeProcess:
    """Start a shard server process serving data_dir on a free loopback port."""
    return NodeProcess(data_dir, cluster_key, socket_timeout=socket_timeout).start()
