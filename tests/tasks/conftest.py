"""A real cluster per test: redis-server on a free port, node processes, a Celery worker.

CLI commands run as subprocesses against it, exactly as a user runs them;
assertions read Redis through coordinator.state.metadata.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.local.cluster import LocalCluster
from coordinator.state.metadata import Metadata


class Cluster(LocalCluster):
    def cli(
        self, *argv: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", *argv],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"smoltorrent {' '.join(argv)} exited {proc.returncode}:\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def cli_json(self, *argv: str):
        return json.loads(self.cli(*argv, "--json").stdout)

    @functools.cached_property
    def md(self) -> Metadata:
        # One client for the cluster's life (redis-py reconnects after a Redis restart): a
        # new one per use left a socket open each time, and a pytest worker ran out of
        # descriptors below select's limit.
        return Metadata(self.redis_url)

    def stop(self) -> None:
        super().stop()
        if "md" in self.__dict__:
            self.md.close()

    def register_nodes(self) -> None:
        self.cli("nodes", "add", *(str(n.address) for n in self.node_procs))

    def worker_log(self) -> str:
        return (self.root / "worker.log").read_text(errors="replace")


# A predicate that costs more than its wait (one that runs a `smoltorrent` command: an
# interpreter start, ~0.5 s of CPU) is asked again only after this many times its own cost:
# polled back to back it kept a core busy for the whole wait, on a suite that is CPU-bound.
# A cheap predicate (a Redis read) keeps the short interval, so brief states are still seen.
POLL_COST_FACTOR = 2.0


def wait_until(predicate, timeout: float = 60, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        asked = time.monotonic()
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(max(interval, POLL_COST_FACTOR * (now - asked)))


@pytest.fixture
def make_cluster(tmp_path: Path):
    clusters: list[Cluster] = []

    def make(
        nodes: int = 4,
        *,
        worker: bool = True,
        retries: int = 2,
        concurrency: int = 4,
        cluster_key: str | None = None,
        chunks: bool | None = None,
        **env,
    ) -> Cluster:
        """A cluster of `nodes` node processes. Its stores are in smoltorrent's default
        format unless `chunks` says: True chunks (schema 3), False whole shards (schema 2),
        for the tests of a version stored in the old format."""
        cluster = Cluster(
            tmp_path / f"cluster{len(clusters)}",
            nodes=nodes,
            host_id=f"test{len(clusters)}",
            worker_concurrency=concurrency,
            cluster_key=cluster_key,
            extra_env={
                "SMOLTORRENT_TRANSFER_RETRIES": str(retries),
                **({} if chunks is None else {"SMOLTORRENT_CHUNKS": "1" if chunks else "0"}),
                **env,
            },
        )
        clusters.append(cluster)
        cluster.start(worker=worker)
        cluster.register_nodes()
        return cluster

    yield make
    for cluster in clusters:
        # The worker and beat get a power cut, not their ~2 s warm shutdown: nothing reads
        # them after the test. Nodes and Redis still stop cleanly (cluster.stop).
        cluster.kill_worker()
        cluster.kill_beat()
        cluster.stop()
