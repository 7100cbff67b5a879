"""A started LocalCluster with its nodes registered, for a bench that stores through it:
every bench that saves through the API began with the same start, `smoltorrent nodes
add` and stop."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from coordinator.local.cluster import LocalCluster

REGISTER_TIMEOUT_S = 120  # `nodes add` probes each node once; a loaded box takes seconds


@contextlib.contextmanager
def registered_cluster(root: Path, nodes: int, **options: Any) -> Iterator[LocalCluster]:
    """A LocalCluster under `root` (Redis, `nodes` node processes, a Celery worker;
    `options` as LocalCluster takes them), its nodes registered, stopped on the way out."""
    cluster = LocalCluster(root, nodes=nodes, **options)
    try:
        cluster.start()
        subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "nodes", "add"]
            + [str(n.address) for n in cluster.node_procs],
            env=cluster.env(),
            check=True,
            capture_output=True,
            timeout=REGISTER_TIMEOUT_S,
        )
        yield cluster
    finally:
        cluster.stop()
