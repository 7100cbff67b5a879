"""Issue 24's "the CLI tells the truth" papercuts, each run through the real CLI as a
subprocess against a real cluster (Redis, shard servers, a Celery worker)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local.cluster import LocalCluster
from coordinator.local.synthetic import write_checkpoint
from tests.coordinator.cli.test_papercuts import run


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """Two registered nodes and a worker."""
    cluster = LocalCluster(tmp_path / "cluster", nodes=2)
    try:
        cluster.start()
        added = run(
            "nodes", "add", *(str(n.address) for n in cluster.node_procs), env=cluster.env()
        )
        assert added.returncode == 0, added.stderr
        yield cluster
    finally:
        cluster.stop()


def store(cluster: LocalCluster, tmp_path: Path, name: str, *argv: str):
    src = tmp_path / (name.replace("/", "_") + ".safetensors")
    if not src.exists():  # the same name stores the same bytes again
        write_checkpoint(src, 300_000, hidden=32)
    past = time.time() - 60  # settled: the store does not wait for the file to settle
    os.utime(src, (past, past))
    return run("store", str(src), "--name", name, *argv, env=cluster.env())


def test_status_sums_up_and_fails_when_a_blob_has_no_copy(cluster: LocalCluster, tmp_path: Path):
    """`status` listed its rows with no summary and exited 0 even with blobs at no copy, so
    cron and monitoring could not tell a healthy cluster from a losing one."""
    stored = store(cluster, tmp_path, "run/a.safetensors", "--replicas", "1")
    assert stored.returncode == 0, stored.stderr
    healthy = run("status", env=cluster.env())
    assert healthy.returncode == 0, healthy.stderr
    assert healthy.stdout.splitlines()[-1].startswith("healthy:"), healthy.stdout
    for node in cluster.node_procs:
        node.stop()
    lost = run("status", env=cluster.env())
    assert lost.returncode == 1, lost.stdout + lost.stderr
    last = lost.stdout.splitlines()[-1]
    assert last.startswith("NOT HEALTHY:") and "0/2 nodes up" in last, lost.stdout
    assert "no live copy" in last
    answer = run("status", "--json", env=cluster.env())
    assert answer.returncode == 1
    summary = json.loads(answer.stdout)["summary"]
    assert summary["healthy"] is False and summary["shards_without_copy"] > 0
