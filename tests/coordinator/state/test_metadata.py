"""Metadata on a real redis-server (started here, on a free port, in a temp dir)."""

from __future__ import annotations

import os
import signal

import pytest

from coordinator.dataplane.store_engine import PreparedStore, prepare_store
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.embedded_redis import start_redis
from coordinator.state.metadata import COMMITTED, Metadata

FREE = {"node-a": 10**12, "node-b": 10**12}


@pytest.fixture
def md(tmp_path):
    pid, port = start_redis(tmp_path / "redis")
    yield Metadata(f"redis://127.0.0.1:{port}/0")
    os.kill(pid, signal.SIGTERM)


def prepared(tmp_path, name: str, seed: int) -> PreparedStore:
    path = tmp_path / f"{name}-{seed}.safetensors"
    write_checkpoint(path, 200_000 + seed, hidden=32)
    return prepare_store(path, name, FREE, replicas=2, shards=2)


def pending(md: Metadata, p: PreparedStore, task_id: str = "t1") -> bool:
    return md.create_pending(p.manifest, p.vkey, {"task_id": task_id}, list(p.targets))


def test_the_barrier_fires_once_and_only_when_every_transfer_settled(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 1)
    assert pending(md, p) is True
    assert pending(md, p, "t2") is False  # the same bytes again: one version
    digests = [s.blob_sha256 for s in p.manifest.shards]
    fired = [
        md.settle(p.vkey, 0, 0, "node-a", digests[0]),
        md.settle(p.vkey, 0, 1, None, digests[0]),  # a dead replica still settles
        md.settle(p.vkey, 1, 0, "node-b", digests[1]),
        md.settle(p.vkey, 1, 1, "node-a", digests[1]),
    ]
    assert fired == [False, False, False, True]
    assert md.settle(p.vkey, 1, 1, "node-a", digests[1]) is False  # a redelivery
    assert md.placement(digests[0]) == {"node-a"}
    assert md.ready_shards(p.vkey) == {0, 1}


def test_a_shard_with_no_copy_holds_the_barrier_until_its_replay_succeeds(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 2)
    pending(md, p)
    d = [s.blob_sha256 for s in p.manifest.shards]
    assert not md.settle(p.vkey, 0, 0, "node-a", d[0])
    assert not md.settle(p.vkey, 0, 1, "node-b", d[0])
    assert not md.settle(p.vkey, 1, 0, None, d[1])
    assert not md.settle(p.vkey, 1, 1, None, d[1])  # all settled, shard 1 has no copy
    assert md.settle(p.vkey, 1, 0, "node-a", d[1]) is True  # the replayed transfer


def test_an_older_version_committing_late_does_not_become_current(md, tmp_path):
    old, new = prepared(tmp_path, "latest", 3), prepared(tmp_path, "latest", 4)
    assert old.manifest.created_at < new.manifest.created_at
    pending(md, old)
    pending(md, new)
    assert md.commit(new.vkey, "latest") is True
    assert md.commit(old.vkey, "latest") is False
    assert md.current("latest") == new.vkey
    assert md.version(old.vkey)["state"] == COMMITTED  # still gatherable by version
    md.delete_version(new.vkey)
    assert md.current("latest") == old.vkey  # the newest remaining committed one


def test_dead_letters_are_recorded_listed_and_removed(md):
    md.add_dead_letter("transfer-x-0-1", {"task": "smoltorrent.transfer", "error": "boom"})
    md.add_dead_letter("transfer-x-1-1", {"task": "smoltorrent.transfer", "error": "bang"})
    assert [r["task_id"] for r in md.dead_letters()] == ["transfer-x-0-1", "transfer-x-1-1"]
    assert md.dead_letter_depth() == 2
    md.remove_dead_letter("transfer-x-0-1")
    assert md.dead_letter("transfer-x-1-1")["error"] == "bang"
    assert md.r.xlen("smoltorrent:dlq:stream") == 2  # the index keeps the history
