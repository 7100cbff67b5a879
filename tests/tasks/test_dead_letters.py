"""What the dead-letter receiver makes of a failure, run in this process against a real
redis-server: a task cut off from Redis did not fail, so it is left open (the worker's
reconnection check or the reconcile sweep sends it again), while a task that failed at a
node is a dead letter whose replicas settle as failed."""

from __future__ import annotations

import os
import signal

import kombu.exceptions
import pytest
import redis
from billiard.exceptions import TimeLimitExceeded

import tasks.dead_letters
import tasks.enqueue
from coordinator.local.synthetic import synthetic_manifest
from coordinator.plan.version_ids import storage_key
from coordinator.state.embedded_redis import start_redis, url_for
from coordinator.state.metadata import Metadata
from smoltorrent.errors import NodeUnavailableError
from tasks import pool_runs
from tasks.chain import chain_transfer
from tasks.chain_batches import ChainEntry, chain_message, chain_task_id

NODES = ["a" * 32, "b" * 32]


@pytest.fixture
def md(tmp_path, monkeypatch):
    pid, port = start_redis(tmp_path / "redis")
    md = Metadata(url_for(tmp_path / "redis", port))
    monkeypatch.setattr(tasks.dead_letters, "metadata", lambda: md)
    monkeypatch.setattr(tasks.enqueue, "metadata", lambda: md)
    yield md
    os.kill(pid, signal.SIGTERM)


def _chain_failed(md: Metadata, exception: Exception, said=()) -> tuple[str, str]:
    """A pending one-shard version whose chain task fails with `exception`: its vkey and the
    chain's task id. `said`: (pid, "#retries state") the worker's pool processes said of it
    (tasks/pool_runs.py)."""
    name = "cut/model.safetensors"
    manifest = synthetic_manifest(name, 1)
    manifest = type(manifest)(**{**manifest.__dict__, "shards": manifest.shards[:1]})
    vkey = storage_key(name, manifest.version_id)
    md.versions.create_pending(manifest, vkey, {"host": "test"}, [tuple(NODES)])
    task_id = f"chain-{vkey}-0-0-1"
    pool_runs.DIRECTORY.mkdir(exist_ok=True)
    for pid, words in said:
        (pool_runs.DIRECTORY / str(pid)).write_text(task_id + words)
    kwargs = {
        "vkey": vkey,
        "name": name,
        "shard": 0,
        "replicas": [0, 1],
        "node_ids": NODES,
        "digest": manifest.shards[0].blob_sha256,
    }
    tasks.dead_letters.record_dead_letter(
        sender=chain_transfer, task_id=task_id, exception=exception, kwargs=kwargs
    )
    return vkey, task_id


@pytest.mark.parametrize(
    "lost",
    [
        redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:6379."),
        redis.exceptions.TimeoutError("Timeout reading from socket"),
        kombu.exceptions.OperationalError("Error 111 connecting to 127.0.0.1:6379."),
    ],
    ids=type,
)
def test_a_task_cut_off_from_redis_is_left_open_not_dead_lettered(md, lost):
    """Redis killed while the chain's retry was being recorded (seen in CI): the failure
    reached the receiver once Redis was back, which dead-lettered the chain and settled
    its replicas as failed, so the version committed at one copy of R=2."""
    vkey, _ = _chain_failed(md, lost)
    assert md.dead_letters.dead_letters() == []
    assert md.transfers.settled(vkey) == set()
    assert md.versions.state(vkey) == "pending"


@pytest.fixture
def pool_files():
    """What the pool processes said (tasks/pool_runs.py) goes after the test."""
    yield
    pool_runs._clear()


def test_a_hard_time_limit_on_a_run_whose_result_was_lost_is_not_a_dead_letter(md, pool_files):
    """A chain whose result Celery lost with the broker connection (tasks/pool_runs.py) is
    shown running until its hard time limit, long after its process said it ended and the
    reconnection sent it again (beat/reconnect.py): that limit is no failure of the task,
    and a dead letter then would settle replicas as failed that the run sent again placed."""
    vkey, _ = _chain_failed(md, TimeLimitExceeded(242), said=[(1, "#2 ended"), (2, "#3 ended")])
    assert md.dead_letters.dead_letters() == []
    assert md.transfers.settled(vkey) == set()


@pytest.mark.parametrize(
    "said", [[(1, "#2 ended"), (2, "#3 running")], []], ids=["one-running", "nothing-said"]
)
def test_a_hard_time_limit_on_a_run_still_running_is_a_dead_letter(md, pool_files, said):
    vkey, task_id = _chain_failed(md, TimeLimitExceeded(242), said=said)
    assert md.dead_letters.dead_letter(task_id)["error"].startswith("TimeLimitExceeded")
    assert md.transfers.settled(vkey) == {"0:0", "0:1"}


def test_a_task_that_failed_at_a_node_is_a_dead_letter(md):
    vkey, task_id = _chain_failed(md, NodeUnavailableError("cannot reach node 127.0.0.1:1"))
    assert md.dead_letters.dead_letter(task_id)["node"] == ",".join(NODES)
    assert md.transfers.settled(vkey) == {"0:0", "0:1"}


def test_a_dead_lettered_batch_settles_every_entry_it_carries(md):
    """A chain task carrying three chunks' chains fails for good: every replica of every
    entry settles as failed, not only its first entry's, or the version would wait forever."""
    name = "batch/model.safetensors"
    manifest = synthetic_manifest(name, 1, shards=3)
    vkey = storage_key(name, manifest.version_id)
    md.versions.create_pending(manifest, vkey, {"host": "test"}, [tuple(NODES)] * 3)
    entries = [
        ChainEntry(i, (0, 1), tuple(NODES), manifest.shards[i].blob_sha256) for i in range(3)
    ]
    kwargs = {"vkey": vkey, "name": name, **chain_message(entries)}
    assert len(kwargs["more"]) == 2
    tasks.dead_letters.record_dead_letter(
        sender=chain_transfer,
        task_id=chain_task_id(vkey, entries),
        exception=NodeUnavailableError("cannot reach node 127.0.0.1:1"),
        kwargs=kwargs,
    )
    assert md.dead_letters.dead_letter(chain_task_id(vkey, entries))["kwargs"] == kwargs
    assert md.transfers.settled(vkey) == {f"{i}:{r}" for i in range(3) for r in (0, 1)}
