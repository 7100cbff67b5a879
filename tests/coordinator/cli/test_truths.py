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
from tests.checkpoints import write_hf_dir
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


def test_ls_in_a_pipe_is_clean_rows_lists_a_prefix_and_hides_directory_records(
    cluster: LocalCluster, tmp_path: Path
):
    """In a pipe `ls` printed `name *` and the legend line among its rows; `ls run2/` listed
    nothing; a directory's internal NAME/.directory.safetensors record showed as a row."""
    model = tmp_path / "model"
    write_hf_dir(model, parts=2)
    past = time.time() - 60
    for f in model.iterdir():
        os.utime(f, (past, past))
    stored = run("store", str(model), "--name", "model", "--replicas", "1", env=cluster.env())
    assert stored.returncode == 0, stored.stderr
    for name in ("run2/a.safetensors", "run2/b.safetensors", "run3/a.safetensors"):
        assert store(cluster, tmp_path, name, "--replicas", "1").returncode == 0
    listing = run("ls", env=cluster.env())
    assert listing.returncode == 0, listing.stderr
    header, *rows = [line.split("\t") for line in listing.stdout.splitlines()]
    assert header[:3] == ["name", "version", "current"]
    assert all(len(row) == len(header) for row in rows), listing.stdout  # no legend line
    names = [row[0] for row in rows]
    assert "run2/a.safetensors" in names and all(row[2] == "*" for row in rows)
    assert any(n.startswith("model/") for n in names)
    assert not any(n.endswith(".directory.safetensors") for n in names), names
    prefix = run("ls", "run2/", env=cluster.env())
    assert prefix.returncode == 0, prefix.stderr
    assert [line.split("\t")[0] for line in prefix.stdout.splitlines()[1:]] == [
        "run2/a.safetensors",
        "run2/b.safetensors",
    ]
    answer = json.loads(run("ls", "model/", "--json", env=cluster.env()).stdout)
    assert answer and all(r["name"].startswith("model/") for r in answer)
    assert not any(r["name"].endswith(".directory.safetensors") for r in answer)


def test_replicas_above_the_nodes_up_is_refused_before_anything_is_recorded(
    cluster: LocalCluster, tmp_path: Path
):
    """`--replicas 5` with 4 nodes recorded the store at 5, warned and exited 0; from then
    on `verify` failed and `status` listed its blobs as unrepairable for ever."""
    refused = store(cluster, tmp_path, "r3.safetensors", "--replicas", "3")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr
    assert "(2 of 2 registered)" in refused.stderr and "--replicas 2 or fewer" in refused.stderr
    assert json.loads(run("ls", "--json", env=cluster.env()).stdout) == []


def copies(cluster: LocalCluster, name: str) -> tuple[int, list[int]]:
    """(the R recorded for `name`'s current version, its blobs' copy counts)."""
    from coordinator.state.metadata import Metadata

    md = Metadata(cluster.redis_url)
    vkey = md.versions.current(name)
    manifest = md.versions.manifest(vkey)
    counts = [len(md.blobs.placement(e.blob_sha256)) for e in manifest.entries]
    return int(md.versions.version(vkey)["replicas"]), counts


def test_replicas_given_again_for_stored_content_raise_or_lower_its_copies(
    cluster: LocalCluster, tmp_path: Path
):
    """`store --replicas 2` of content already stored at 1 printed `already stored ... x 1
    replicas` and exited 0, as if it now held the copies asked for. Now it records R=2 for
    that version and waits for the second copies; `--replicas 1` lowers it, and a copy
    is trimmed only where no other version using the blob asks for more. A store of the
    same bytes without --replicas leaves R as it is."""
    assert store(cluster, tmp_path, "same.safetensors", "--replicas", "1").returncode == 0
    assert copies(cluster, "same.safetensors")[0] == 1
    raised = store(cluster, tmp_path, "same.safetensors", "--replicas", "2")
    assert raised.returncode == 0, raised.stdout + raised.stderr
    assert "copies raised from 1 to 2" in raised.stdout, raised.stdout
    r, counts = copies(cluster, "same.safetensors")
    assert r == 2 and set(counts) == {2}, counts  # waited for: every blob at 2 already
    again = store(cluster, tmp_path, "same.safetensors")
    assert again.returncode == 0 and "already stored" in again.stdout, again.stderr
    assert copies(cluster, "same.safetensors")[0] == 2
    # The same bytes under another name share every blob, at R=2.
    same = (tmp_path / "same.safetensors.safetensors").read_bytes()  # the file store() wrote
    (tmp_path / "twin.safetensors.safetensors").write_bytes(same)
    assert store(cluster, tmp_path, "twin.safetensors", "--replicas", "2").returncode == 0
    lowered = store(cluster, tmp_path, "same.safetensors", "--replicas", "1")
    assert lowered.returncode == 0, lowered.stdout + lowered.stderr
    assert "copies lowered from 2 to 1" in lowered.stdout, lowered.stdout
    r, counts = copies(cluster, "same.safetensors")
    assert r == 1 and set(counts) == {2}, counts  # twin still asks for 2
    assert run("ls", "same.safetensors", env=cluster.env()).returncode == 0
    lowered = store(cluster, tmp_path, "twin.safetensors", "--replicas", "1")
    assert lowered.returncode == 0, lowered.stdout + lowered.stderr
    assert set(copies(cluster, "twin.safetensors")[1]) == {1}  # waited for: trimmed
    gathered = run("gather", "same.safetensors", "-o", str(tmp_path / "out"), env=cluster.env())
    assert gathered.returncode == 0, gathered.stderr
    assert (tmp_path / "out").read_bytes() == same


def test_replicas_that_cannot_change_stored_copies_say_so(cluster: LocalCluster, tmp_path: Path):
    """Where `--replicas` cannot change the copies of bytes already stored (a store that
    does not wait, a directory's files stored before), the store said nothing, and `ls`
    later showed the old R. Now it warns; it still exits 0 and nothing else changes."""
    assert store(cluster, tmp_path, "nw.safetensors", "--replicas", "1").returncode == 0
    queued = store(cluster, tmp_path, "nw.safetensors", "--replicas", "2", "--no-wait")
    assert queued.returncode == 0, queued.stderr
    assert "keep the copies they have" in queued.stderr, queued.stderr
    write_hf_dir(tmp_path / "hf")
    first = run("store", str(tmp_path / "hf"), "--name", "hf", env=cluster.env())
    assert first.returncode == 0 and "keep the copies" not in first.stderr, first.stderr
    again = run("store", str(tmp_path / "hf"), "--name", "hf", "--replicas", "1", env=cluster.env())
    assert again.returncode == 0, again.stderr
    assert "files keep the copies they have" in again.stderr, again.stderr
