"""The worker's log at its default level (issue 24): the `event=done` lines the docs
promise are there, no line carries Celery's `???[???]` (a task logger's name and id written
outside a task), and a planned retry (a store waiting for its file to settle) is INFO."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from coordinator.local.cluster import LocalCluster
from coordinator.local.synthetic import write_checkpoint
from tests.coordinator.cli.test_papercuts import run


def test_the_worker_logs_its_events_at_info_by_default(tmp_path: Path):
    cluster = LocalCluster(tmp_path / "cluster", nodes=1, host_id="logs")
    try:
        cluster.start(worker=False)
        added = run("nodes", "add", str(cluster.node_procs[0].address), env=cluster.env())
        assert added.returncode == 0, added.stderr
        cluster.worker = cluster._spawn_cli("worker")  # no --loglevel: its default
        cluster.wait_for_worker()
        src = tmp_path / "fresh.safetensors"
        write_checkpoint(src, 60_000, hidden=16)
        # Dated 5 s ahead, it is still being written when the task first looks, however
        # slowly the CLI starts: dated now, a loaded box found it settled and there was no
        # retry to log (CI at 4 tests at a time, 2026-12-06), as test_event_log once did.
        ahead = time.time() + 5
        os.utime(src, (ahead, ahead))
        stored = run("store", str(src), "--replicas", "1", env=cluster.env())
        assert stored.returncode == 0, stored.stderr
        cluster.stop_worker()  # a warm shutdown: every line it had is written
        text = (cluster.root / "worker.log").read_text()
    finally:
        cluster.stop()
    assert "???" not in text, text
    assert re.search(r"INFO.* event=done task=store name=fresh\.safetensors", text), text
    retries = [line for line in text.splitlines() if "event=retry" in line]
    assert retries and all("WARNING" not in line for line in retries), text
    assert re.search(r"INFO.* boot of logs: ", text), text
