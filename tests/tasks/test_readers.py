"""A machine that only reads needs no worker: `gather` and `load` there run the gather in
their own process (same engine, replica fallback, verification) into any path the user
can write, with a request on record. A worker writes a gather sent through the broker only
under the staging directory and SMOLTORRENT_GATHER_DIRS, never the whole home."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from coordinator.local.synthetic import write_checkpoint
from coordinator.state.redis_keys import REQUEST
from smoltorrent import defaults

TIMEOUT_S = 120.0  # seconds for one process on a loaded box


def reader_env(cluster, tmp_path: Path) -> dict[str, str]:
    """A second machine: its own host id (no worker serves it) and its own home."""
    home = tmp_path / "reader-home"
    home.mkdir(exist_ok=True)
    return cluster.env() | {"SMOLTORRENT_HOST_ID": "reader", "HOME": str(home)}


def run(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def requests_of(cluster, host: str) -> list[dict[str, str]]:
    r = cluster.md.r
    records = [r.hgetall(key) for key in r.scan_iter(REQUEST.format(rid="*"))]
    return [rec for rec in records if rec.get("host") == host]


@pytest.fixture
def stored(make_cluster, tmp_path: Path):
    """A cluster whose worker (host test0) stored one checkpoint; the reader writes outside
    every directory the worker allows."""
    cluster = make_cluster(SMOLTORRENT_GATHER_DIRS=str(tmp_path / "allowed"))
    src = tmp_path / "model.safetensors"
    write_checkpoint(src, 2 * 1024 * 1024, hidden=128)
    cluster.cli("store", str(src))
    return cluster, src


def test_a_reader_with_no_worker_gathers_anywhere_it_can_write(stored, tmp_path: Path):
    cluster, src = stored
    out_dir = tmp_path / "srv" / "restore"  # outside the reader's home and every allow-list
    out_dir.mkdir(parents=True)
    out = out_dir / "x.safetensors"
    env = reader_env(cluster, tmp_path)
    argv = ["-X", "importtime", "-m", "coordinator.cli", "gather", "model.safetensors"]
    proc = run(env, *argv, "-o", str(out))
    # It said "refusing to write ...: gathers write only under <home>, <cwd>, <staging>".
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == src.read_bytes()
    # Celery and kombu were a tenth of a second or more of its start, for nothing.
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines()}
    assert not {m for m in imported if m.split(".")[0] in ("celery", "kombu")}
    assert [p.name for p in out_dir.iterdir()] == ["x.safetensors"]  # no temp file left
    (record,) = requests_of(cluster, "reader")  # on record, as every request is
    assert record["kind"] == "gather-in-process" and record["state"] == "done"
    assert json.loads(record["result"])["path"] == str(out)

    # A gather that fails (no node answers) says so, leaves nothing, and is on record.
    for node in cluster.node_procs:
        node.stop()
    failed = out_dir / "y.safetensors"
    proc = run(env, "-m", "coordinator.cli", "gather", "model.safetensors", "-o", str(failed))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "no good replica" in proc.stderr
    assert [p.name for p in out_dir.iterdir()] == ["x.safetensors"]
    assert sorted(r["state"] for r in requests_of(cluster, "reader")) == ["done", "failed"]


LOAD = """
import sys, smoltorrent
from smoltorrent.tensors import read_file
want = read_file(sys.argv[1], "numpy")
got = smoltorrent.load("model.safetensors", framework="numpy")
assert got.keys() == want.keys()
assert all(got[k].tobytes() == want[k].tobytes() for k in want)
part = smoltorrent.load("model.safetensors", framework="numpy", tensors=["lm_head.weight"])
assert list(part) == ["lm_head.weight"]
assert part["lm_head.weight"].tobytes() == want["lm_head.weight"].tobytes()
print("loaded", len(got))
"""


def test_load_on_a_reader_with_no_worker(stored, tmp_path: Path):
    cluster, src = stored
    proc = run(reader_env(cluster, tmp_path), "-c", LOAD, str(src))
    # It failed: "no smoltorrent worker is serving this host (reader)", or, with a staging
    # directory outside SMOLTORRENT_GATHER_DIRS, "refusing to write".
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("loaded ")
    assert {r["kind"] for r in requests_of(cluster, "reader")} == {"gather-in-process"}


def test_a_worker_writes_a_sent_gather_only_under_staging_and_the_listed_dirs(
    make_cluster, tmp_path: Path
):
    home = tmp_path / "home"
    home.mkdir()
    # SMOLTORRENT_GATHER_DIRS empty: the worker's default list alone.
    cluster = make_cluster(2, SMOLTORRENT_GATHER_DIRS="", HOME=str(home))
    src = tmp_path / "g.safetensors"
    write_checkpoint(src, 1_000_000, hidden=64)
    cluster.cli("store", str(src))
    vkey = cluster.md.versions.current("g.safetensors")
    app = Celery(broker=cluster.redis_url, backend=cluster.redis_url)
    sent = app.send_task(
        "smoltorrent.gather", args=(vkey, str(home / ".bashrc")), queue="host.test0"
    )
    # Its default was the whole home: a message in the broker wrote the user's dotfiles.
    with pytest.raises(Exception, match="write only under"):
        sent.get(timeout=defaults.LOCAL_START_TIMEOUT_S * 4)
    assert list(home.iterdir()) == []
    staging = cluster.root / "staging"
    staging.mkdir(exist_ok=True)
    sent = app.send_task(
        "smoltorrent.gather", args=(vkey, str(staging / "g.safetensors")), queue="host.test0"
    )
    assert sent.get(timeout=defaults.LOCAL_START_TIMEOUT_S * 4)["path"] == str(
        staging / "g.safetensors"
    )
    assert (staging / "g.safetensors").read_bytes() == src.read_bytes()
    app.close()
