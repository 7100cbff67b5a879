"""The beat tests run on the same real clusters as the task tests, with a real
`smoltorrent beat` process started by the `beat` fixture."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.tasks.conftest import make_cluster  # noqa: F401  (a fixture, used by name)


@pytest.fixture
def beat(tmp_path):
    """start(cluster) runs `smoltorrent beat` against the cluster (its log: beat.log)."""
    procs = []

    def start(cluster) -> subprocess.Popen:
        log = open(tmp_path / "beat.log", "ab")  # noqa: SIM115  (closed with the process)
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "beat", "--loglevel", "INFO"],
            env=cluster.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs.append((proc, log))
        return proc

    yield start
    for proc, log in procs:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:  # a beat stuck in its stop must not outlive the test
            proc.kill()
            proc.wait()
        log.close()
