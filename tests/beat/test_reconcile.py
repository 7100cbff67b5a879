"""The reconcile sweep on a real cluster: `smoltorrent beat`, a real worker, real nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from coordinator import config
from coordinator.dataplane.store_engine import prepare_store, store_checkpoint
from coordinator.state.versions import COMMITTED
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import committed, make_ckpt, sha

FAST = {"SMOLTORRENT_RECONCILE_INTERVAL_S": "1", "SMOLTORRENT_RECONCILE_GRACE_S": "1"}


def pending_as_left_by_a_crash(c, src, *, send_blobs: bool):
    """A pending version in Redis as a store leaves it when it dies at a chosen point:
    with every transfer done and settled but no commit queued (`send_blobs`), or planned
    with none of its transfer messages surviving."""
    md = c.md
    host = c.host_id
    if send_blobs:
        result = store_checkpoint(src, [n.address for n in c.node_procs], shards=2)
        manifest = result.manifest
        targets = [tuple(result.holders[i]) for i in range(len(manifest.entries))]
        identity = prepare_store(src, src.name, {n: 10**12 for n in md.nodes.nodes()}).identity
    else:
        prepared = prepare_store(src, src.name, {n: 10**12 for n in md.nodes.nodes()}, shards=2)
        manifest, targets, identity = prepared.manifest, list(prepared.targets), prepared.identity
    vkey = manifest.storage_key()
    fields = {"path": str(src), "host": host, "identity": json.dumps(identity.to_dict())}
    assert md.versions.create_pending(manifest, vkey, fields, targets) == "created"
    if send_blobs:
        fired = [
            md.transfers.settle(vkey, i, r, node, manifest.entries[i].blob_sha256)
            for i, nodes in enumerate(targets)
            for r, node in enumerate(nodes)
        ]
        assert fired[-1] is True  # the barrier said "commit now" ... and the process died
    return vkey


def test_a_crash_between_barrier_and_commit_is_committed_by_reconcile(make_cluster, beat, tmp_path):
    c = make_cluster(3, **FAST)
    src = make_ckpt(tmp_path / "c.safetensors")
    vkey = pending_as_left_by_a_crash(c, src, send_blobs=True)
    assert c.md.versions.version(vkey)["state"] == "pending"
    beat(c)
    wait_until(
        lambda: c.md.versions.version(vkey)["state"] == COMMITTED, timeout=60, what="the commit"
    )
    out = tmp_path / "out.safetensors"
    c.cli("gather", "c.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_commit_asks_the_holders_and_resends_a_shard_no_node_has(make_cluster, beat, tmp_path):
    """Every copy of a shard deleted between the barrier and the commit (a remove that
    raced, a foreign tool): the commit asks the holders, sends the shard again, and only
    then commits."""
    from coordinator.dataplane.node_client import NodeClient

    c = make_cluster(3, **FAST)
    src = make_ckpt(tmp_path / "h.safetensors")
    vkey = pending_as_left_by_a_crash(c, src, send_blobs=True)
    lost = c.md.versions.manifest(vkey).entries[1].blob_sha256
    for n in c.node_procs:
        NodeClient(n.address).delete(lost)
    assert c.md.blobs.placement(lost)  # the metadata still believes in the copies
    beat(c)
    wait_until(
        lambda: c.md.versions.version(vkey)["state"] == COMMITTED, timeout=60, what="the commit"
    )
    assert any(lost in NodeClient(n.address).list_blobs() for n in c.node_procs)
    out = tmp_path / "out.safetensors"
    c.cli("gather", "h.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_lost_transfer_messages_are_sent_again_by_reconcile(make_cluster, beat, tmp_path):
    c = make_cluster(3, retries=0, SMOLTORRENT_TRANSFER_TIME_BASE_S="2", **FAST)
    src = make_ckpt(tmp_path / "t.safetensors")
    vkey = pending_as_left_by_a_crash(c, src, send_blobs=False)
    beat(c)
    wait_until(
        lambda: c.md.versions.version(vkey)["state"] == COMMITTED, timeout=60, what="the commit"
    )
    assert {a["shard"] for a in c.md.transfers.attempts(vkey)} == {0, 1}
    out = tmp_path / "out.safetensors"
    c.cli("gather", "t.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_sweep_whose_lock_is_held_does_nothing(make_cluster, tmp_path):
    """Two beat instances: the second sweep finds the first one's lock and stands down."""
    from celery import Celery

    c = make_cluster(2, **FAST)
    src = make_ckpt(tmp_path / "l.safetensors")
    vkey = pending_as_left_by_a_crash(c, src, send_blobs=True)
    app = Celery(broker=c.redis_url, backend=c.redis_url)
    try:
        lock = c.md.r.lock("smoltorrent:sweep:reconcile:lock", timeout=60)
        assert lock.acquire(blocking=False)
        held = app.send_task("smoltorrent.sweep.reconcile", queue="control").get(timeout=60)
        assert "skipped" in held
        assert c.md.versions.version(vkey)["state"] == "pending"
        lock.release()
        ran = app.send_task("smoltorrent.sweep.reconcile", queue="control").get(timeout=60)
        assert ran["commits"] == 1
    finally:
        app.close()
    wait_until(
        lambda: c.md.versions.version(vkey)["state"] == COMMITTED, timeout=60, what="the commit"
    )


def queued_copies(c, request_ids: list[str]) -> dict[str, int]:
    """How many messages of each request's task wait in a queue or are held, fetched and
    not acked, by the worker (the Redis transport's lists and its unacked hash)."""
    raws = [m for q in c.md.r.keys("host.*") for m in c.md.r.lrange(q, 0, -1)]
    raws += [json.dumps(json.loads(m)[0]) for m in c.md.r.hvals("unacked")]
    ids = [json.loads(m)["headers"]["id"] for m in raws]
    return {rid: ids.count(rid) for rid in request_ids}


def test_a_request_merely_queued_behind_a_busy_worker_is_not_sent_again(
    make_cluster, beat, tmp_path
):
    """A backlog: the live worker takes nothing from this host's queue (its consumer of it
    cancelled), so two stores wait there, queued, while the sweep runs many times past
    its grace. It sends neither again: each has one message. It sent every such request
    again each pass, and under a real backlog each copy ran in full."""
    from celery import Celery

    c = make_cluster(3, **FAST)
    control = Celery(broker=c.redis_url).control
    worker, queue = [f"smoltorrent@{c.host_id}"], config.host_queue(c.host_id)
    assert control.cancel_consumer(queue, destination=worker, reply=True)
    try:
        rids = [
            c.cli_json("store", str(make_ckpt(tmp_path / f"{i}.safetensors")), "--no-wait")[
                "task_id"
            ]
            for i in range(2)
        ]
        queued_at = c.md.sweeps.redis_time()
        beat(c)
        wait_until(
            lambda: (
                len([r for r in c.md.sweeps.sweep_runs("reconcile") if r["started"] > queued_at])
                >= 5
            ),
            timeout=60,
            what="five reconcile passes",
        )
        # The phase: both requests still queued, long past the sweep's grace.
        assert [c.md.requests.request(rid)["state"] for rid in rids] == ["queued", "queued"]
        assert queued_copies(c, rids) == {rid: 1 for rid in rids}
    finally:
        control.add_consumer(queue, destination=worker, reply=True)
    for i in range(2):
        wait_until(lambda i=i: committed(c, f"{i}.safetensors"), timeout=60, what="the stores")


def test_a_worker_killed_while_the_commit_runs_loses_no_acknowledged_store(make_cluster, tmp_path):
    """The commit task held mid-run (every node SIGSTOPped, so it waits on their answer),
    then the worker SIGKILLed: a `store` the CLI is waiting on still commits once a worker
    starts again (its start re-drives the commit), and the CLI exits 0 with the bytes
    stored whole."""
    c = make_cluster(3, concurrency=2)
    src = make_ckpt(tmp_path / "k.safetensors")
    vkey = pending_as_left_by_a_crash(c, src, send_blobs=True)
    # Every node stopped first: a commit sent by the store's own join then waits on them
    # too. Stopped after the store, that commit could finish first on a loaded machine,
    # and the held phase below never came (CI: "timed out waiting for the commit task").
    for node in c.node_procs:
        node.send_signal(signal.SIGSTOP)
    try:
        # An acknowledged store of those bytes: its task joins the pending version and
        # ends; the CLI waits for the commit. Cut as the crash's store cut them (2 shards):
        # cut by its own plan it made another version on CI, whose transfers to the stopped
        # nodes took both pool slots, and the commit below never started.
        store = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "store", str(src), "--shards", "2"],
            env=c.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: not c.md.requests.open_requests(), what="the store request to be served")
        assert c.md.listing.pending_versions() == [vkey]  # it joined the crashed version
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from tasks.enqueue import send_commit; send_commit(sys.argv[1])",
                vkey,
            ],
            env=c.env(),
            check=True,
            timeout=60,
        )
        # The phase held: the commit task runs (Celery marks it started), the version is
        # still pending.
        meta = f"celery-task-meta-commit-{vkey}"
        wait_until(lambda: '"STARTED"' in (c.md.r.get(meta) or ""), what="the commit task to run")
        assert c.md.versions.version(vkey)["state"] == "pending"
        os.killpg(c.worker.pid, signal.SIGKILL)
        c.worker.wait()
    finally:
        for node in c.node_procs:
            node.send_signal(signal.SIGCONT)
    assert c.md.versions.version(vkey)["state"] == "pending"
    c.start_worker()
    _, err = store.communicate(timeout=120)
    assert store.returncode == 0, err
    assert c.md.versions.version(vkey)["state"] == COMMITTED
    out = tmp_path / "out.safetensors"
    c.cli("gather", "k.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
