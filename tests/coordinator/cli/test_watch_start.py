"""`watch` (issue 24): a mistyped directory or a file path is refused at start instead of
watched ("is gone; waiting for it to come back"), and a file still being written is
waited for with one line, not a warning again at every pause of its writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local.synthetic import write_checkpoint
from tests.coordinator.cli.test_papercuts import TIMEOUT_S, one_line_error, run
from tests.tasks.conftest import Cluster, wait_until


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("watch"), nodes=1, host_id="watchstart")
    try:
        cluster.start()
        cluster.register_nodes()
        yield cluster
    finally:
        cluster.kill_worker()
        cluster.stop()


def test_watch_refuses_a_missing_directory_and_a_file(c: Cluster, tmp_path: Path):
    missing = run("watch", str(tmp_path / "chekpoints"), env=c.env())
    assert missing.returncode == 1, missing.stdout + missing.stderr
    assert "no such directory" in one_line_error(missing)
    a_file = tmp_path / "step_1.safetensors"
    write_checkpoint(a_file, 10_000, hidden=8)
    refused = run("watch", str(a_file), env=c.env())
    assert refused.returncode == 1, refused.stdout + refused.stderr
    error = one_line_error(refused)
    assert "is a file" in error and str(tmp_path) in error


def past(path: Path) -> None:
    """Date the file back: as far as the watcher's settle time goes, its writer paused."""
    then = time.time() - 60
    os.utime(path, (then, then))


def test_a_file_still_being_written_is_waited_for_quietly(c: Cluster, tmp_path: Path):
    root = tmp_path / "run"
    root.mkdir()
    whole = tmp_path / "whole.safetensors"
    write_checkpoint(whole, 200_000, hidden=16)
    data = whole.read_bytes()
    log = tmp_path / "watch.log"
    with open(log, "ab") as out:
        watch = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "watch", str(root)],
            env=c.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        target = root / "a.safetensors"
        # A writer that pauses longer than the settle time, twice, before it finishes.
        for cut in (len(data) // 3, 2 * len(data) // 3):
            with open(target, "ab") as f:
                f.write(data[f.tell() : cut])
            past(target)
            # A complete file after it: once the watcher queued that one, it has looked at
            # a.safetensors as it is now (same pass, in name order, or an earlier one).
            marker = root / f"z{cut}.safetensors"
            write_checkpoint(marker, 10_000, hidden=8)
            past(marker)
            queued = f"path={marker} "
            wait_until(lambda q=queued: q in log.read_text(), TIMEOUT_S, what=marker.name)
        with open(target, "ab") as f:
            f.write(data[f.tell() :])
        past(target)
        wait_until(lambda: f"path={target} " in log.read_text(), TIMEOUT_S, what="its store")
    finally:
        watch.send_signal(signal.SIGTERM)
        watch.wait(timeout=TIMEOUT_S)
    text = log.read_text()
    about = [line for line in text.splitlines() if "a.safetensors" in line]
    assert "WARNING" not in text, text
    assert len([line for line in about if "still being written" in line]) == 1, text
    assert "event=queued name=a.safetensors" in text
