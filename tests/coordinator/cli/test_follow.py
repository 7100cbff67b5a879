"""Issue 24: a store the CLI stops waiting for goes on, and the CLI says so and how to
follow it. Real CLI subprocesses against one real cluster for the module; the worker is
held with SIGSTOP so the store is still queued when the CLI is interrupted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local.cluster import LocalCluster
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.metadata import Metadata
from tests.coordinator.cli.test_papercuts import TIMEOUT_S, run


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Two registered nodes and a worker, shared by the module's tests."""
    cluster = LocalCluster(tmp_path_factory.mktemp("follow"), nodes=2)
    try:
        cluster.start()
        added = run(
            "nodes", "add", *(str(n.address) for n in cluster.node_procs), env=cluster.env()
        )
        assert added.returncode == 0, added.stderr
        yield cluster
    finally:
        cluster.stop()


def checkpoint(cluster: LocalCluster, name: str) -> Path:
    src = cluster.root / name
    write_checkpoint(src, 200_000, hidden=32)  # random bytes: new content each time
    past = time.time() - 60  # settled: the store does not wait for the file to settle
    os.utime(src, (past, past))
    return src


def request_id(text: str) -> str:
    found = re.search(r"smoltorrent wait (\S+)`", text)
    assert found, text
    return found.group(1)


def test_ctrl_c_while_a_store_waits_says_it_goes_on_and_wait_follows_it(
    cluster: LocalCluster,
) -> None:
    """Ctrl-C during `store` printed `error: interrupted` and exited 130, as if the store
    were lost, while it committed in the background."""
    src = checkpoint(cluster, "held.safetensors")
    md = Metadata(cluster.redis_url)
    # Every node stopped: the worker takes the store and waits on them while the CLI waits
    # on the store. Ctrl-C once the worker has taken it (its run, or the pending version
    # its run made: the run itself lasts milliseconds and a poll on a loaded machine can
    # miss it), so its message has surely been sent.
    for node in cluster.node_procs:
        os.kill(node.pid, signal.SIGSTOP)
    try:
        cli = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "store", str(src), "--replicas", "1"],
            env=cluster.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + TIMEOUT_S

        def running() -> bool:
            runs = [r.get("state") == "running" for _, r in md.requests.open_requests()]
            return any(runs) or bool(md.listing.pending_versions())

        while not running():
            assert cli.poll() is None and time.monotonic() < deadline, cli.communicate()
            time.sleep(0.05)
        cli.send_signal(signal.SIGINT)
        out, err = cli.communicate(timeout=TIMEOUT_S)
    finally:
        for node in cluster.node_procs:
            os.kill(node.pid, signal.SIGCONT)
    assert cli.returncode == 3, out + err
    assert "Traceback" not in err and "error: interrupted" not in err, err
    assert "goes on" in err and "held.safetensors" in err, err
    rid = request_id(err)
    followed = run("wait", rid, env=cluster.env())
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "stored: held.safetensors version" in followed.stdout
    listed = json.loads(run("ls", "held.safetensors", "--json", env=cluster.env()).stdout)
    assert [v["state"] for v in listed] == ["committed"]
    md.close()


def test_store_no_wait_says_how_to_follow_and_wait_reports_the_end(cluster: LocalCluster):
    src = checkpoint(cluster, "queued.safetensors")
    queued = run("store", str(src), "--replicas", "1", "--no-wait", env=cluster.env())
    assert queued.returncode == 0, queued.stderr
    rid = request_id(queued.stdout)
    answer = run("wait", rid, "--json", env=cluster.env())
    assert answer.returncode == 0, answer.stdout + answer.stderr
    report = json.loads(answer.stdout)
    assert report["name"] == "queued.safetensors" and report["state"] == "committed"


def test_wait_on_an_unknown_request_fails_with_a_hint(cluster: LocalCluster) -> None:
    unknown = run("wait", "no-such-request", env=cluster.env())
    assert unknown.returncode == 1, unknown.stdout + unknown.stderr
    assert "no request no-such-request" in unknown.stderr and "Traceback" not in unknown.stderr
