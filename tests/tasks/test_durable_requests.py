"""Requests and version order survive crashes and rollbacks: real Redis, worker, nodes, CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime

from coordinator.state import redis_keys as K
from coordinator.state.versions import COMMITTED
from tests import held_cli
from tests.tasks.conftest import wait_until
from tests.tasks.test_chunked_store import node_bytes
from tests.tasks.test_control_plane import committed, make_ckpt, sha


def test_a_rolled_back_checkpoint_gathers_the_rolled_back_bytes(make_cluster, tmp_path):
    """A, B, A under one name (training restored an earlier state and re-saved it)."""
    c = make_cluster(3)
    a = make_ckpt(tmp_path / "a.safetensors", 1_000_000)
    b = make_ckpt(tmp_path / "b.safetensors", 1_100_000)
    name = "run/latest.safetensors"
    first = c.cli_json("store", str(a), "--name", name)
    c.cli_json("store", str(b), "--name", name)
    third = c.cli_json("store", str(a), "--name", name)
    assert third["new"] is False and third["vkey"] == first["vkey"]  # no bytes moved
    out = tmp_path / "out.safetensors"
    c.cli("gather", name, "-o", str(out))
    assert sha(out) == sha(a)
    rows = [r for r in c.cli_json("ls") if r["name"] == name]
    assert [r["vkey"] for r in rows if r["current"]] == [first["vkey"]]


def test_a_rollback_is_still_current_after_losing_redis_and_a_rebuild(make_cluster, tmp_path):
    """A, B, A again, then Redis is lost and rebuilt from the nodes: the name serves A,
    its latest request. The rebuild ordered versions by created_at, so B (created after
    A) took the name back; the nodes' copies of a manifest now carry its request order."""
    c = make_cluster(2)
    a = make_ckpt(tmp_path / "a.safetensors", 600_000)
    b = make_ckpt(tmp_path / "b.safetensors", 700_000)
    name = "run/latest.safetensors"
    first = c.cli_json("store", str(a), "--name", name)
    second = c.cli_json("store", str(b), "--name", name)
    assert c.cli_json("store", str(a), "--name", name)["new"] is False
    c.md.r.flushall()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert summary["restored"] == 2
    assert c.md.versions.current(name) == first["vkey"] != second["vkey"]
    out = tmp_path / "out.safetensors"
    c.cli("gather", name, "-o", str(out))
    assert sha(out) == sha(a)


def test_worker_killed_while_the_store_plans_loses_nothing(make_cluster, tmp_path):
    """SIGKILL the worker while its store task plans (it stops itself as it starts cutting
    and hashing the file: held, not timed, as a delay after a big file's `--no-wait` was);
    a restarted worker completes the store on its own."""
    c = make_cluster(4, concurrency=2)
    src = make_ckpt(tmp_path / "big.safetensors", 20_000_000)
    c.kill_worker()
    worker = held_cli.start_worker(
        c.env(), "tasks.store:prepare_chunked_store", c.root / "held-worker.log"
    )
    try:
        wait_until(c.worker_answers, timeout=120, what="the held worker")
        c.cli("store", str(src), "--no-wait")
        wait_until(lambda: held_cli.stopped_child(worker.pid), timeout=120, what="the store held")
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    # The phase: the request is recorded, no version yet.
    assert len(c.md.requests.open_requests()) == 1 and c.md.listing.pending_versions() == []
    c.start_worker()
    rows = wait_until(
        lambda: committed(c, "big.safetensors"), timeout=60, what="the store to commit itself"
    )
    assert len([r for r in c.cli_json("ls") if r["name"] == "big.safetensors"]) == 1
    assert rows[0]["min_copies"] == 2
    assert c.md.requests.open_requests() == []
    out = tmp_path / "out.safetensors"
    c.cli("gather", "big.safetensors", "-o", str(out), timeout=300)
    assert sha(out) == sha(src)


def test_a_failed_request_is_reported_and_closed(make_cluster, tmp_path):
    # One back-off (1 s) before the store gives up, not four (15 s): the failure is the point.
    c = make_cluster(1, SMOLTORRENT_NO_NODE_RETRIES="1")
    src = make_ckpt(tmp_path / "f.safetensors")
    c.node_procs[0].kill()
    c.md.nodes.mark_down(c.md.nodes.nodes().popitem()[0])  # not counted alive from an earlier probe
    proc = c.cli("store", str(src), check=False)
    assert proc.returncode == 1 and "no storage node is reachable" in " ".join(proc.stderr.split())
    assert c.md.requests.open_requests() == []
    assert [v for v in c.cli_json("ls") if v["state"] == COMMITTED] == []


def test_a_store_while_every_node_restarts_waits_for_them_and_commits(make_cluster, tmp_path):
    """Every node down (restarting) when the store task plans: it backs off and tries
    again, and commits once they are back a few seconds later. It failed at once with
    "no storage node is reachable" and a dead letter."""
    c = make_cluster(2)
    src = make_ckpt(tmp_path / "n.safetensors")
    for node in c.node_procs:
        node.kill()
    for node_id in c.md.nodes.nodes():
        c.md.nodes.mark_down(node_id)  # not counted alive from an earlier probe
    store = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "store", str(src), "--json"],
        env=c.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The phase: the store task has met no node (it is waiting out its backoff).
    wait_until(
        lambda: "no storage node is reachable" in c.worker_log() or store.poll() is not None,
        timeout=60,
        what="the store task to find no node",
    )
    for node in c.node_procs:
        node.start()
    out, err = store.communicate(timeout=120)
    assert store.returncode == 0, err
    assert json.loads(out)["state"] == COMMITTED
    assert c.cli_json("dlq", "ls") == []


def test_redis_killed_mid_store_and_restarted_from_its_aof(make_cluster, tmp_path):
    """redis-server SIGKILLed while a store's transfers are in flight and started again
    from its AOF 3 s later: the tasks that lost Redis retry instead of dead-lettering,
    what the worker held and Celery dropped is sent again as it reconnects, and the store
    commits once. The phase is held, not timed: the nodes are SIGSTOPped, so the store
    plans and its transfers wait on them (a kill 1 s into a 300 MB store could land while
    the file was still being hashed)."""
    c = make_cluster(4, retries=6)
    src = make_ckpt(tmp_path / "r.safetensors", 20_000_000)
    for node in c.node_procs:
        node.send_signal(signal.SIGSTOP)
    try:
        c.cli("store", str(src), "--shards", "8", "--no-wait")
        # Planned, and its transfers cannot end: the nodes are stopped.
        [vkey] = wait_until(c.md.listing.pending_versions, what="the store's pending version")
        c.kill_redis()
        killed = time.monotonic()
        wait_until(lambda: time.monotonic() - killed >= 3, interval=0.05, what="3 s of outage")
        c.start_redis()
        assert c.md.versions.state(vkey) == "pending"  # the phase: nothing moved meanwhile
    finally:
        for node in c.node_procs:
            node.send_signal(signal.SIGCONT)
    rows = wait_until(
        lambda: committed(c, "r.safetensors"), timeout=120, what="the store to commit itself"
    )
    assert c.worker.poll() is None  # the worker lived through the outage
    assert len([r for r in c.cli_json("ls") if r["name"] == "r.safetensors"]) == 1
    assert rows[0]["vkey"] == vkey and rows[0]["min_copies"] == 2
    assert c.cli_json("dlq", "ls") == []
    out = tmp_path / "out.safetensors"
    c.cli("gather", "r.safetensors", "-o", str(out), timeout=300)
    assert sha(out) == sha(src)


def _held_retries(c, task: str) -> list[int]:
    """The retry counts of `task` messages a worker has fetched and not acked yet with a
    countdown still to wait: the Redis transport keeps each in its `unacked` hash. Only
    those due more than a second from now: one whose ETA has come is running (acked when
    it ends), and Redis killed then would take the next retry it just sent (the CI saw
    that, 11 ms after the send), not a retry the worker holds."""
    out = []
    for raw in c.md.r.hvals("unacked"):
        headers = json.loads(raw)[0]["headers"]
        eta = headers.get("eta")
        due_in = datetime.fromisoformat(eta).timestamp() - time.time() if eta else 0.0
        if headers.get("task") == task and due_in > 1.0:
            out.append(int(headers.get("retries") or 0))
    return out


def test_a_retry_the_worker_holds_when_redis_dies_is_sent_again(make_cluster, tmp_path):
    """A chain retry waiting out its countdown in the worker when redis-server is
    SIGKILLed: Celery drops it from its timer at the connection loss and cannot put it
    back into the dead Redis, so it would wait in the restarted one for the visibility
    timeout (hours). The worker re-sends, as it reconnects, what no live task holds.
    It failed 4 runs in about 250 when the retry before it ended 3 ms before the kill: the
    main process never read that run's result (the pool's pipe for that process had no
    reader after the reconnection, 52 KB left unread), showed it running for good and
    waited on it; its pool process's own word now says it ended (tasks/pool_runs.py)."""
    c = make_cluster(2, retries=6)
    src = make_ckpt(tmp_path / "e.safetensors")
    c.node_procs[1].kill()  # its replica retries: no other node can take it
    c.cli("store", str(src), "--shards", "1", "--no-wait")
    # The third retry waits 4 s: long enough to kill Redis while the worker holds it.
    wait_until(
        lambda: any(r >= 3 for r in _held_retries(c, "smoltorrent.chain")),
        timeout=60,
        what="a chain retry held by the worker",
    )
    c.kill_redis()
    c.node_procs[1].start()
    c.start_redis()
    rows = wait_until(
        lambda: committed(c, "e.safetensors"), timeout=60, what="the store to commit itself"
    )
    assert c.worker.poll() is None  # the worker lived through the outage
    # It failed 1 run in ~13 (min_copies 1) while the failure of a chain whose retry could
    # not be recorded (Redis gone) was dead-lettered once Redis was back: if it comes
    # back, say why.
    vkey = rows[0]["vkey"]
    digest = c.md.versions.manifest(vkey).entries[0].blob_sha256
    why = {
        "placement": sorted(c.md.blobs.placement(digest)),
        "listed": c.md.r.hget(K.PLACEMENTS_LISTED, digest),
        "attempts": c.md.transfers.attempts(vkey),
        "worker log": c.worker_log()[-4000:],
    }
    assert rows[0]["min_copies"] == 2, why
    assert c.cli_json("dlq", "ls") == []
    out = tmp_path / "out.safetensors"
    c.cli("gather", "e.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_checkpoint_with_no_tensors_commits_with_its_manifest_on_nodes(make_cluster, tmp_path):
    import json as _json
    import struct

    c = make_cluster(3)
    empty = tmp_path / "empty.safetensors"
    header = _json.dumps({"__metadata__": {"step": "0"}}).encode()
    empty.write_bytes(struct.pack("<Q", len(header)) + header)
    past = time.time() - 60
    os.utime(empty, (past, past))
    row = c.cli_json("store", str(empty))
    assert row["state"] == COMMITTED and row["shards"] == 0
    v = c.md.versions.version(row["vkey"])
    assert v["commit_enqueued"]  # it went through the barrier like any other version
    from coordinator.dataplane.node_client import NodeClient

    keeping = [n for n in c.node_procs if row["vkey"] in NodeClient(n.address).list_manifests()]
    assert len(keeping) == 2  # min(R, live nodes)
    out = tmp_path / "out.safetensors"
    c.cli("gather", "empty.safetensors", "-o", str(out))
    assert sha(out) == sha(empty)


def test_a_refused_manifest_is_retried_not_dead_lettered(make_cluster, tmp_path):
    """Every node refuses the manifest (its manifests directory is a plain file, as after
    a foreign tool or a damaged card): the commit retries with backoff instead of turning
    the first failure into a dead letter, and commits once the nodes take manifests."""
    import shutil

    from coordinator.dataplane.node_client import NodeClient

    c = make_cluster(2)
    src = make_ckpt(tmp_path / "m.safetensors")
    for node in c.node_procs:
        shutil.rmtree(node.data_dir / "manifests")
        (node.data_dir / "manifests").write_bytes(b"not a directory")
    c.cli("store", str(src), "--no-wait")
    wait_until(
        lambda: c.worker_log().count("ManifestNotDurableError") >= 2,
        timeout=60,
        what="two refused manifest writes, retried",
    )
    (vkey,) = c.md.versions.versions("m.safetensors")
    assert c.md.versions.version(vkey)["state"] != COMMITTED
    assert c.cli_json("dlq", "ls") == []
    for node in c.node_procs:
        (node.data_dir / "manifests").unlink()
        (node.data_dir / "manifests").mkdir()
    wait_until(lambda: committed(c, "m.safetensors"), timeout=60, what="commit once fixed")
    for node in c.node_procs:
        assert vkey in NodeClient(node.address).list_manifests()
    assert c.cli_json("dlq", "ls") == []


def _held_gather(make_cluster, tmp_path, stem: str):
    """A 2-node cluster holding STEM.safetensors at R=2, both nodes SIGSTOPped, and a
    `smoltorrent gather` of it started: its run is held while it waits on them (the
    caller sends SIGCONT). (cluster, source, output path, the gather's process)."""
    c = make_cluster(2, concurrency=2)
    src = make_ckpt(tmp_path / f"{stem}.safetensors", 2_000_000)
    c.cli("store", str(src), "--replicas", "2")
    out = c.root / f"{stem}-out.safetensors"
    for node in c.node_procs:
        node.send_signal(signal.SIGSTOP)
    gather = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "gather", src.name, "-o", str(out)],
        env=c.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return c, src, out, gather


def _redrive(c, rid: str, record: dict[str, str]) -> None:
    """Send request `rid`'s task again, as the reconcile sweep sends an open one."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; from tasks.enqueue import redrive_request; "
            "redrive_request(sys.argv[1], json.loads(sys.argv[2]))",
            rid,
            json.dumps(record),
        ],
        env=c.env(),
        check=True,
        timeout=60,
    )


def _held_run(c) -> tuple[str, dict[str, str]]:
    """The held gather's request once a run owns it: (its id, its record)."""
    rid, record = wait_until(
        lambda: next(iter(c.md.requests.open_requests()), None), what="the gather request"
    )
    wait_until(lambda: c.md.requests.request(rid).get("owner"), what="its run")
    return rid, record


def _partials(c) -> list[str]:
    """The gather temp files beside the cluster's outputs."""
    return [p.name for p in c.root.iterdir() if p.name.endswith(".partial")]


def test_a_gather_delivered_again_while_it_runs_waits_for_the_first_run(make_cluster, tmp_path):
    """Two real deliveries of one gather request: the first run is held mid-transfer (both
    holders SIGSTOPped, its temp file already reserved), the second is sent with the same
    request id. The second must leave the request to the first (one temp file, one run),
    and the gather ends once with the right bytes. It ran in full beside the first:
    start_request short-circuited only a done request."""
    c, src, out, gather = _held_gather(make_cluster, tmp_path, "d")
    try:
        # The phase held: the first run owns the request and has reserved its temp file.
        rid, record = _held_run(c)
        wait_until(lambda: _partials(c), what="the first run's temp file")
        _redrive(c, rid, record)
        # The second delivery either defers to the first run or starts a gather of its own.
        wait_until(
            lambda: c.md.requests.request(rid).get("deferred") or len(_partials(c)) > 1,
            what="the second delivery",
        )
        assert len(_partials(c)) == 1, _partials(c)
        assert c.md.requests.request(rid)["state"] == "running"
    finally:
        for node in c.node_procs:
            node.send_signal(signal.SIGCONT)
    _, err = gather.communicate(timeout=120)
    assert gather.returncode == 0, err
    assert sha(out) == sha(src) and _partials(c) == []
    assert c.md.requests.request(rid)["state"] == "done"
    assert "event=deferred task=gather" in c.worker_log()


def test_a_gather_whose_pool_child_is_killed_is_run_again(make_cluster, tmp_path):
    """The OOM killer takes the pool child running a gather (SIGKILL of that process only;
    the worker's main process lives on, same boot). Celery retries a task whose worker was
    lost after the task's default_retry_delay, 180 s unless set: the gather sat idle for 3
    minutes (and the CLI waiting on it) before it ran again. It must run again at once,
    take over the dead run's lease, and end with the bytes whole."""
    c, src, out, gather = _held_gather(make_cluster, tmp_path, "oom")
    try:
        rid, _ = _held_run(c)
        owner = c.md.requests.request(rid)["owner"]
        child = int(owner.rpartition(":")[2])
        assert child != c.worker.pid  # a pool child, not the worker's main process
        os.kill(child, signal.SIGKILL)
    finally:
        for node in c.node_procs:
            node.send_signal(signal.SIGCONT)
    _, err = gather.communicate(timeout=60)  # not the 180 s of Celery's default
    assert gather.returncode == 0, err
    assert c.worker.poll() is None  # the same worker, never restarted
    assert sha(out) == sha(src) and _partials(c) == []  # nor the dead run's temp file
    assert c.md.requests.request(rid)["state"] == "done"


def test_a_gather_whose_worker_is_killed_mid_gather_finishes_after_a_restart(
    make_cluster, tmp_path
):
    """The whole worker (main process and pool) SIGKILLed while a sent gather waits on its
    SIGSTOPped holders, its temp file reserved: a worker started again re-drives the
    request as it boots, and the `gather` waiting on it exits 0 with the bytes whole and
    no temp file left beside them (a dead run's reserved file is the checkpoint's size)."""
    c, src, out, gather = _held_gather(make_cluster, tmp_path, "k")
    try:
        rid, _ = _held_run(c)
        wait_until(lambda: _partials(c), what="its temp file")
        c.kill_worker()
        # The phase: the run is gone mid-gather, nothing is at the destination yet.
        assert c.md.requests.request(rid)["state"] == "running" and not out.exists()
        c.start_worker()
    finally:
        for node in c.node_procs:
            node.send_signal(signal.SIGCONT)
    _, err = gather.communicate(timeout=120)
    assert gather.returncode == 0, err
    assert sha(out) == sha(src)
    assert _partials(c) == []
    assert c.md.requests.request(rid)["state"] == "done"


def test_a_finished_gather_delivered_again_returns_its_recorded_result_and_moves_nothing(
    make_cluster, tmp_path
):
    """A worker's gather that finished, sent again with its own task and request id (as
    the reconcile sweep re-drives a request, or as Celery redelivers a message whose
    worker died between closing the request and acking): the task returns the result
    recorded by the first run. No node sends a byte, the file is the first run's (same
    inode, same mtime) and the request stays as that run closed it."""
    c = make_cluster(2, SMOLTORRENT_METRICS_PORT="0")
    src = make_ckpt(tmp_path / "f.safetensors", 1_000_000)
    c.cli("store", str(src))
    out = c.root / "f-out.safetensors"
    c.cli("gather", src.name, "-o", str(out))
    assert c.worker_log().count("event=done task=gather") == 1  # the worker's, not the CLI's
    [(rid, record)] = [
        (key.rpartition(":")[2], r)
        for key in c.md.r.scan_iter(K.REQUEST.format(rid="*"))
        if (r := c.md.r.hgetall(key)).get("kind") == "gather"
    ]
    assert record["state"] == "done"
    written, sent = out.stat(), node_bytes(c, "smoltorrent_node_bytes_sent_total")
    _redrive(c, rid, record)
    wait_until(
        lambda: (
            c.worker_log().count("event=done task=gather") == 2
            or "event=failed task=gather" in c.worker_log()
        ),
        what="the second delivery to end",
    )
    assert "event=failed task=gather" not in c.worker_log()
    # What each delivery returned, as the worker logs it: the second, the first run's.
    returned = re.findall(rf"gather\[{rid}\] succeeded in [0-9.e-]+s: (.*)", c.worker_log())
    assert len(returned) == 2 and returned[1] == returned[0]
    stored = json.loads(c.md.r.get(f"celery-task-meta-{rid}"))
    assert stored["status"] == "SUCCESS" and stored["result"] == json.loads(record["result"])
    assert node_bytes(c, "smoltorrent_node_bytes_sent_total") == sent
    now = out.stat()
    assert (now.st_ino, now.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert sha(out) == sha(src) and _partials(c) == []
    assert c.md.requests.request(rid) == record
