"""A worker writes a gather only under the directories it allows, whoever sends the task
(the CLI gathers anywhere else itself: tests/tasks/test_readers.py)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest
from celery import Celery

from coordinator.local.synthetic import write_checkpoint
from smoltorrent import defaults


def test_a_sent_gather_outside_the_allowed_directories_is_refused(make_cluster, tmp_path: Path):
    allowed, elsewhere = tmp_path / "allowed", tmp_path / "elsewhere"
    allowed.mkdir()
    elsewhere.mkdir()
    c = make_cluster(2, SMOLTORRENT_GATHER_DIRS=str(allowed))
    src = tmp_path / "g.safetensors"
    write_checkpoint(src, 1_000_000, hidden=64)
    past = time.time() - 60  # settled: the store does not wait for the file to settle
    os.utime(src, (past, past))
    c.cli("store", str(src))

    # Someone who can reach the broker sends the task itself: the worker refuses it.
    app = Celery(broker=c.redis_url, backend=c.redis_url)
    vkey = c.md.versions.current("g.safetensors")
    target = elsewhere / "sneaky"
    result = app.send_task("smoltorrent.gather", args=(vkey, str(target)), queue="host.test0")
    with pytest.raises(Exception, match="write only under") as refused:
        result.get(timeout=defaults.LOCAL_START_TIMEOUT_S * 4)
    assert str(allowed) in str(refused.value) and "SMOLTORRENT_GATHER_DIRS" in str(refused.value)
    assert list(elsewhere.iterdir()) == []

    out = allowed / "out.safetensors"
    c.cli("gather", "g.safetensors", "-o", str(out))
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()


def test_gather_into_an_existing_directory_writes_the_file_by_its_name(make_cluster, tmp_path):
    """`-o DIR` as cp takes it: the checkpoint lands in DIR under its file name. Before, a
    directory was taken for the output file: "[Errno 21] Is a directory", or, for the
    allowed directory itself, "gathers write only under" that same directory."""
    c = make_cluster(2, SMOLTORRENT_GATHER_DIRS=str(tmp_path))
    src = tmp_path / "g.safetensors"
    write_checkpoint(src, 1_000_000, hidden=64)
    past = time.time() - 60
    os.utime(src, (past, past))
    c.cli("store", str(src), "--name", "run1/model.safetensors")
    out = tmp_path / "into"
    out.mkdir()
    report = c.cli_json("gather", "run1/model.safetensors", "-o", str(out))
    assert report["path"] == str(out / "model.safetensors")
    assert (out / "model.safetensors").read_bytes() == src.read_bytes()
    c.cli("gather", "run1/model.safetensors", "-o", str(tmp_path))  # the allowed dir itself
    assert (tmp_path / "model.safetensors").read_bytes() == src.read_bytes()


@pytest.mark.parametrize("worker", [True, False], ids=["by-the-worker", "in-process"])
def test_gather_never_replaces_a_file_that_is_not_a_checkpoint_unless_forced(
    make_cluster, tmp_path, worker
):
    """Issue 40: `gather NAME -o` pointed at the system's password file replaced it and
    exited 0. A file there that is not a checkpoint stays, and the error says what it is
    and how to replace it (--force); an earlier checkpoint there is replaced as before."""
    c = make_cluster(2, worker=worker, SMOLTORRENT_GATHER_DIRS=str(tmp_path))
    src = tmp_path / "g.safetensors"
    write_checkpoint(src, 300_000, hidden=32)
    past = time.time() - 60
    os.utime(src, (past, past))
    if not worker:
        c.start_worker()
    c.cli("store", str(src))
    if not worker:
        c.stop_worker()
    precious = tmp_path / "passwd"
    precious.write_text("root:x:0:0:root:/root:/bin/bash\n")
    refused = c.cli("gather", "g.safetensors", "-o", str(precious), check=False)
    assert refused.returncode == 2, refused.stderr
    assert "not a checkpoint" in refused.stderr and "--force" in refused.stderr
    assert precious.read_text() == "root:x:0:0:root:/root:/bin/bash\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".passwd")] == []

    c.cli("gather", "g.safetensors", "-o", str(precious), "--force")
    assert precious.read_bytes() == src.read_bytes()
    earlier = tmp_path / "earlier.safetensors"
    write_checkpoint(earlier, 200_000, hidden=16)  # a checkpoint: replaced without asking
    c.cli("gather", "g.safetensors", "-o", str(earlier))
    assert earlier.read_bytes() == src.read_bytes()
