"""No broker message and no Redis value names a path a delivery task deletes
(tasks/delivery_policy.py, coordinator/dataplane/chunk_source.py): a version key is 32 hex
digits before it becomes the spool's directory name, and a chunk's spooled file is found
in its version's spool directory by its index, never at a path Redis holds."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid

import kombu

from coordinator import config
from coordinator.dataplane.chunk_engine import prepare_chunked_store
from coordinator.plan.blob_spans import BlobSpan
from coordinator.state import redis_keys as K
from tests.tasks.conftest import wait_until
from tests.tasks.test_chunked_store import model, write
from tests.tasks.test_control_plane import make_ckpt


def task_headers(task: str, task_id: str, args: tuple, kwargs: dict) -> dict:
    """The headers of a task message in Celery's protocol 2, as a test puts one on a queue
    by hand (as anyone who reaches Redis could)."""
    return {
        "lang": "py",
        "task": task,
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "eta": None,
        "expires": None,
        "timelimit": [None, None],
        "argsrepr": repr(args),
        "kwargsrepr": repr(kwargs),
        "origin": "test",
    }


# Celery's protocol 2 body is (args, kwargs, embed); embed's keys go onto the request.
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def send_json_task(redis_url: str, queue: str, task: str, kwargs: dict) -> str:
    """A JSON task message put on `queue` with kombu; its id."""
    task_id = str(uuid.uuid4())
    with kombu.Connection(redis_url) as connection:
        connection.Producer().publish(
            json.dumps([[], kwargs, EMBED]),
            routing_key=queue,
            content_type="application/json",
            content_encoding="utf-8",
            headers=task_headers(task, task_id, (), kwargs),
            correlation_id=task_id,
        )
    return task_id


def victim_directory(tmp_path) -> tuple[os.PathLike, os.PathLike]:
    """A directory holding a file: what a path smuggled into a message must never remove."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_bytes(b"keep me")
    return victim, victim / "precious"


def test_a_transfer_message_whose_vkey_is_a_path_deletes_nothing(make_cluster, tmp_path):
    """A smoltorrent.transfer sent with kombu, its vkey the absolute path of a directory,
    with a pending version planted in Redis under that key whose source no longer matches:
    the task abandoned the version and removed spool_dir(root, vkey), which
    os.path.join made the directory itself. The task now refuses the key."""
    c = make_cluster(2)
    src = make_ckpt(tmp_path / "v.safetensors", 1_000_000)
    real = c.cli_json("store", str(src))["vkey"]
    victim, precious = victim_directory(tmp_path)
    vkey = str(victim)
    version = c.md.r.hgetall(K.VERSION.format(vkey=real))
    identity = json.loads(version["identity"])
    changed = {**identity, "size": identity["size"] + 1}  # the source "changed" since
    c.md.r.hset(
        K.VERSION.format(vkey=vkey),
        mapping={**version, "state": "pending", "identity": json.dumps(changed)},
    )
    span = c.md.transfers.span(real, 0)
    # A blob no node holds: the task must send it from the source, and checks it first.
    planted = BlobSpan(0, os.urandom(32).hex(), span.length, b"", span.offset, span.length)
    c.md.r.hset(K.SPANS.format(vkey=vkey), "0", planted.to_json())
    [node_id] = sorted(c.md.nodes.nodes())[:1]
    task_id = send_json_task(
        c.redis_url,
        config.transfer_queue(c.host_id),
        "smoltorrent.transfer",
        {
            "vkey": vkey,
            "name": "v.safetensors",
            "shard": 0,
            "replica": 0,
            "node_id": node_id,
            "digest": planted.digest,
        },
    )
    wait_until(
        lambda: (
            f"[{task_id}] succeeded" in c.worker_log() or f"[{task_id}] raised" in c.worker_log()
        ),
        timeout=60,
        what="the worker to run the message",
    )
    assert precious.read_bytes() == b"keep me", c.worker_log()
    assert c.md.versions.state(vkey) == "pending"  # refused before it touched anything
    assert "refusing the version key" in c.worker_log()


def test_a_spool_path_planted_in_redis_is_never_deleted(make_cluster, tmp_path):
    """A pending version of this host left by a crash, its span's spooled file in Redis
    changed by hand to a file elsewhere: the worker starting again sends the version's
    transfers, and release() unlinked that file (and its directory, once empty) when the
    chunk was placed. The spooled file is now the version's spool directory's
    <index>.chunk, whatever Redis says."""
    c = make_cluster(2)
    src = write(tmp_path / "s.safetensors", model())
    past = os.stat(src).st_mtime - 60
    os.utime(src, (past, past))
    victim, precious = victim_directory(tmp_path)
    free = {n: 10**12 for n in c.md.nodes.nodes()}
    prepared = prepare_chunked_store(src, src.name, free, c.root / "spool", replicas=2)
    vkey = prepared.vkey
    fields = {
        "path": str(src),
        "host": c.host_id,
        "identity": json.dumps(prepared.identity.to_dict()),
    }
    assert c.md.versions.create_pending(prepared.manifest, vkey, fields, prepared.targets)
    c.md.chunks.record(prepared.manifest.chunks)
    spans = list(prepared.spans)
    spooled = [i for i, s in enumerate(spans) if s.spool]
    assert spooled, "the model's chunks are encoded, so spooled"
    first = spooled[0]
    spans[first] = dataclasses.replace(spans[first], spool=str(precious))
    c.md.transfers.keep_spans(vkey, spans)

    c.kill_worker()
    c.start_worker()  # its start sends what the version still needs
    wait_until(lambda: c.md.versions.state(vkey) == "committed", timeout=120, what="the commit")
    assert precious.read_bytes() == b"keep me"
    assert not os.path.exists(os.path.join(c.root, "spool", vkey)), "its own spool is released"
