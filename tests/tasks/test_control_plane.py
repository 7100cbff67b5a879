"""The Celery control plane end to end: real Redis, real worker, real nodes, the real CLI."""

from __future__ import annotations

import hashlib
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from coordinator.dataplane.node_client import NodeClient
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.versions import COMMITTED
from smoltorrent.errors import AuthenticationError
from tests.checkpoints import write_raw
from tests.tasks.conftest import wait_until


def make_ckpt(path: Path, size: int = 4_000_000, *, settled: bool = True) -> Path:
    """An LLM-like checkpoint of about `size` bytes. Its tensors are small, so a chunked
    store packs it into one chunk (make_blobs_ckpt makes several)."""
    write_checkpoint(path, size, hidden=128)
    if settled:  # old enough that the store does not wait for the file to settle
        past = time.time() - 60
        os.utime(path, (past, past))
    return path


def make_blobs_ckpt(path: Path, count: int, each: int = 1 << 20) -> Path:
    """A settled checkpoint of `count` random tensors of `each` bytes (1 MiB or more): as
    many blobs stored in chunks (such a tensor is a chunk of its own) as in `--shards
    count` shards, all different."""
    header, offset = {}, 0
    for i in range(count):
        header[f"w{i}"] = {"dtype": "U8", "shape": [each], "data_offsets": [offset, offset + each]}
        offset += each
    write_raw(path, header, os.urandom(offset), pad_to=8)
    past = time.time() - 60
    os.utime(path, (past, past))
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def committed(cluster, name: str) -> list[dict]:
    return [v for v in cluster.cli_json("ls") if v["name"] == name and v["state"] == COMMITTED]


def node_bytes_received(cluster) -> list[float]:
    """Each node's smoltorrent_node_bytes_received_total, scraped from its /metrics."""
    out = []
    for node in cluster.node_procs:
        port = (node.data_dir / "metrics_port").read_text().strip()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            text = page.read().decode()
        line = next(x for x in text.splitlines() if x.startswith(RECEIVED_METRIC))
        out.append(float(line.split()[-1]))
    return out


RECEIVED_METRIC = "smoltorrent_node_bytes_received_total"


def test_store_gather_round_trip_and_no_bytes_moved_twice(make_cluster, tmp_path):
    c = make_cluster(4, SMOLTORRENT_METRICS_PORT="0")
    src = make_blobs_ckpt(tmp_path / "a.safetensors", 4)
    first = c.cli_json("store", str(src))
    assert first["state"] == COMMITTED and first["new"] is True
    assert first["shards"] == 4 and first["min_copies"] == 2
    received_before = node_bytes_received(c)
    blob_bytes = sum(s.blob_size for s in c.md.versions.manifest(first["vkey"]).entries)
    assert sum(received_before) == 2 * blob_bytes  # every replica counted, once
    again = c.cli_json("store", str(src))
    assert again["new"] is False and again["version_id"] == first["version_id"]
    # Nor was the unchanged file read again: its digests came from the digest cache.
    assert first["hashed_bytes"] > 0 and again["hashed_bytes"] == 0
    # Not one byte reached a node: counting blobs would miss a re-send of them all.
    assert node_bytes_received(c) == received_before
    out = tmp_path / "out.safetensors"
    report = c.cli_json("gather", "a.safetensors", "-o", str(out))
    assert sha(out) == sha(src) and report["size"] == src.stat().st_size
    # Each committed manifest is on the nodes holding its blobs (rebuild relies on it).
    key = c.md.versions.current("a.safetensors")
    nodes = c.md.nodes.nodes()
    holders = {
        n for s in c.md.versions.manifest(key).entries for n in c.md.blobs.placement(s.blob_sha256)
    }
    assert len(holders) == 4
    for node_id in holders:
        assert key in NodeClient(nodes[node_id].address).list_manifests(), node_id


def test_changed_content_moves_only_changed_blobs(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "m.safetensors")
    c.cli_json("store", str(src), "--shards", "4")
    data = bytearray(src.read_bytes())
    data[-10:] = os.urandom(10)  # only the last tensor (lm_head, last shard) changes
    src.write_bytes(bytes(data))
    past = time.time() - 60
    os.utime(src, (past, past))
    second = c.cli_json("store", str(src), "--shards", "4")
    assert second["new"] is True
    attempts = c.md.transfers.attempts(second["vkey"])
    moved = [a for a in attempts if a.get("result") in ("sent", "replicated")]
    assert len(moved) == 2, attempts  # one changed shard x 2 replicas
    assert {a["shard"] for a in moved} == {3}
    versions = [v for v in c.cli_json("ls") if v["name"] == "m.safetensors"]
    assert len(versions) == 2 and sum(v["current"] for v in versions) == 1


def test_bad_checkpoint_is_refused_before_anything_is_queued(make_cluster, tmp_path):
    c = make_cluster(2)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x80\x04\x95pickle-not-safetensors" * 10)
    proc = c.cli("store", str(bad), check=False)
    assert proc.returncode == 1
    assert "safetensors" in proc.stderr
    assert c.md.versions.names() == []


def test_transfer_retries_with_exact_backoff_then_commits(make_cluster, tmp_path):
    c = make_cluster(2, retries=6)
    src = make_ckpt(tmp_path / "b.safetensors")
    down = c.node_procs[1]
    down_id = NodeClient(down.address).ping()
    down.kill()  # still counted alive (heard from seconds ago), so shards are placed on it
    c.cli("store", str(src), "--shards", "1", "--no-wait")
    md = c.md
    vkey = wait_until(
        lambda: next(iter(md.listing.pending_versions()), None), what="pending version"
    )

    def failed_tries() -> int:
        return len(
            [a for a in md.transfers.attempts(vkey) if a["node"] == down_id and "error" in a]
        )

    # Attempts 0-3 fail (1, 2 and 4 s apart), however slowly the box runs; then it is back.
    wait_until(lambda: failed_tries() >= 4, timeout=60, interval=0.02, what="4 failed tries")
    down.start()  # same data dir and port
    wait_until(lambda: committed(c, "b.safetensors"), timeout=60, what="commit")
    vkey = c.md.versions.current("b.safetensors")
    tries = [a for a in c.md.transfers.attempts(vkey) if a["node"] == down_id]
    gaps = [b["at"] - a["at"] for a, b in zip(tries, tries[1:], strict=False)]
    assert [a["attempt"] for a in tries[:4]] == [0, 1, 2, 3], tries
    for gap, want in zip(gaps, [1, 2, 4], strict=False):
        assert want * 0.9 <= gap <= want + 1.5, gaps  # slack for a loaded 2-core CI box
    assert tries[-1].get("result") in ("sent", "replicated")
    assert committed(c, "b.safetensors")[0]["min_copies"] == 2


def test_dead_letter_then_replay_completes_the_checkpoint(make_cluster, tmp_path):
    c = make_cluster(1, retries=1)
    src = make_ckpt(tmp_path / "d.safetensors")
    node = c.node_procs[0]
    node.kill()
    proc = c.cli("store", str(src), "--replicas", "1", check=False)
    assert proc.returncode == 1 and "dlq replay" in proc.stderr
    letters = c.cli_json("dlq", "ls")
    assert len(letters) >= 1
    rec = letters[0]
    assert rec["task"] == "smoltorrent.chain" and rec["checkpoint"] == "d.safetensors"
    assert rec["shard"] == 0 and rec["node"] and "NodeUnavailableError" in rec["error"]
    assert rec["traceback"] and rec["at"] > 0
    assert c.md.versions.current("d.safetensors") is None  # nothing gatherable yet
    node.start()
    c.cli("dlq", "replay", "--all")
    wait_until(lambda: committed(c, "d.safetensors"), timeout=60, what="commit after replay")
    assert c.cli_json("dlq", "ls") == []
    out = tmp_path / "out.safetensors"
    c.cli("gather", "d.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_store_with_a_dead_node_commits_under_replicated_and_a_later_replay_keeps_it(
    make_cluster, tmp_path
):
    # Two nodes: with a third live one, the dead node's replicas would move there instead.
    c = make_cluster(2, retries=1)
    src = make_ckpt(tmp_path / "u.safetensors")
    c.node_procs[1].kill()
    row = c.cli_json("store", str(src), "--shards", "4")
    assert row["state"] == COMMITTED
    assert row["under_replicated"], row
    status = c.cli_json("status")
    assert any(not n["up"] for n in status["nodes"])
    assert {u["shard"] for u in status["under_replicated"]} == set(row["under_replicated"])
    assert status["dead_letters"] == len(row["under_replicated"])
    out = tmp_path / "out.safetensors"
    c.cli("gather", "u.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
    # A dead-letter replay after the commit adds the missing replicas and never touches
    # the committed version's state (a late transfer must not abort or re-commit it).
    (vkey,) = c.md.versions.versions("u.safetensors")
    c.node_procs[1].start()
    c.cli("dlq", "replay", "--all")
    manifest = c.md.versions.manifest(vkey)
    wait_until(
        lambda: all(len(c.md.blobs.placement(s.blob_sha256)) >= 2 for s in manifest.entries),
        timeout=60,
        what="the replayed transfers bring every shard to two copies",
    )
    assert c.md.versions.version(vkey)["state"] == COMMITTED
    assert c.md.versions.current("u.safetensors") == vkey
    assert c.cli_json("dlq", "ls") == []
    assert c.cli_json("status")["under_replicated"] == []


def store_until_first_transfer(c, src: Path) -> str:
    """Start a 16-shard store and return its vkey once one transfer, not all, has settled."""
    c.cli("store", str(src), "--shards", "16", "--no-wait")
    md = c.md
    vkey = wait_until(
        lambda: next(iter(md.listing.pending_versions()), None), what="pending version"
    )
    wait_until(lambda: md.transfers.progress(vkey)[0] >= 1, interval=0.005, what="a first transfer")
    settled, total = md.transfers.progress(vkey)
    assert settled < total, "the store finished before the fault; the test proves nothing"
    return vkey


def test_worker_killed_mid_store_resumes_to_one_clean_version(make_cluster, tmp_path):
    c = make_cluster(4, concurrency=1)
    src = make_ckpt(tmp_path / "k.safetensors", 16_000_000)
    vkey = store_until_first_transfer(c, src)
    md = c.md
    os.killpg(c.worker.pid, signal.SIGKILL)
    c.worker.wait()
    c.start_worker()
    wait_until(lambda: committed(c, "k.safetensors"), timeout=90, what="commit after restart")
    assert len([v for v in c.cli_json("ls") if v["name"] == "k.safetensors"]) == 1
    manifest = md.versions.manifest(vkey)
    digests = {s.blob_sha256 for s in manifest.entries}
    for node in c.node_procs:
        client = NodeClient(node.address)
        assert client.verify() == []
        assert set(client.list_blobs()) <= digests
    out = tmp_path / "out.safetensors"
    c.cli("gather", "k.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_concurrent_stores_and_gather(make_cluster, tmp_path):
    import subprocess
    import sys

    c = make_cluster(4)
    a = make_ckpt(tmp_path / "a.safetensors")
    b = make_ckpt(tmp_path / "b.safetensors", 3_000_000)
    c.cli("store", str(a))
    cmd = [sys.executable, "-m", "coordinator.cli"]
    out = tmp_path / "a.out"
    procs = [
        subprocess.Popen([*cmd, "store", str(b)], env=c.env()),
        subprocess.Popen([*cmd, "store", str(a), "--name", "twice"], env=c.env()),
        subprocess.Popen([*cmd, "store", str(a), "--name", "twice"], env=c.env()),
        subprocess.Popen([*cmd, "gather", "a.safetensors", "-o", str(out)], env=c.env()),
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    assert sha(out) == sha(a)
    rows = c.cli_json("ls")
    assert len([r for r in rows if r["name"] == "twice"]) == 1
    assert {r["name"] for r in rows if r["state"] == COMMITTED} == {
        "a.safetensors",
        "b.safetensors",
        "twice",
    }


def test_redis_restart_and_rebuild_after_flush(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "r.safetensors")
    c.cli("store", str(src))
    c.kill_redis()  # SIGKILL: only the AOF survives
    c.start_redis()
    assert committed(c, "r.safetensors")
    wait_until(c.worker_answers, timeout=60, what="the worker to reconnect to Redis")
    out = tmp_path / "out1.safetensors"
    c.cli("gather", "r.safetensors", "-o", str(out))
    assert sha(out) == sha(src)

    addresses = [str(n.address) for n in c.node_procs]
    c.md.r.flushall()
    assert c.cli_json("ls") == []
    summary = c.cli_json("rebuild", *addresses)
    assert summary["nodes_read"] == 4 and summary["restored"] == 1
    assert committed(c, "r.safetensors")
    out2 = tmp_path / "out2.safetensors"
    c.cli("gather", "r.safetensors", "-o", str(out2))
    assert sha(out2) == sha(src)


def test_rm_keeps_shared_blobs_until_their_last_version_goes(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_blobs_ckpt(tmp_path / "a.safetensors", 4)
    c.cli("store", str(src))
    c.cli("store", str(src), "--name", "copy.safetensors")  # same blobs, second manifest

    def inventory():
        return [
            (NodeClient(n.address).list_blobs(), NodeClient(n.address).list_manifests())
            for n in c.node_procs
        ]

    c.cli("rm", "copy.safetensors", "--yes")
    assert sum(len(blobs) for blobs, _ in inventory()) == 8  # 4 blobs x 2, still used by a
    out = tmp_path / "out.safetensors"
    c.cli("gather", "a.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
    c.cli("rm", "a.safetensors", "--yes")
    assert all(blobs == {} and manifests == [] for blobs, manifests in inventory())
    assert c.cli_json("ls") == []
    proc = c.cli("gather", "a.safetensors", "-o", str(out), check=False)
    assert proc.returncode == 1 and "smoltorrent ls" in proc.stderr


def test_source_rewritten_mid_store_is_abandoned_then_new_bytes_stored(make_cluster, tmp_path):
    c = make_cluster(4, concurrency=1)
    src = make_ckpt(tmp_path / "latest.safetensors", 16_000_000)
    old_sha = sha(src)
    vkey = store_until_first_transfer(c, src)
    md = c.md
    make_ckpt(src, 16_000_000, settled=False)  # training re-saves the same path
    new_sha = sha(src)
    assert new_sha != old_sha

    def new_version_committed():
        rows = [r for r in c.cli_json("ls") if r["name"] == "latest.safetensors"]
        return rows if any(r["state"] == COMMITTED for r in rows) else None

    rows = wait_until(new_version_committed, timeout=90, what="the new content to commit")
    states = {r["vkey"]: r["state"] for r in rows}
    assert states[vkey] == "aborted"
    assert "rewritten" in md.versions.version(vkey)["reason"]
    out = tmp_path / "out.safetensors"
    c.cli("gather", "latest.safetensors", "-o", str(out))
    assert sha(out) == new_sha


def test_cluster_key_end_to_end(make_cluster, tmp_path):
    c = make_cluster(3, cluster_key="s3cret-cluster-key")
    src = make_ckpt(tmp_path / "k.safetensors")
    c.cli("store", str(src))
    out = tmp_path / "out.safetensors"
    c.cli("gather", "k.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
    # Without the key, a node refuses to talk at all.
    with pytest.raises(AuthenticationError):
        NodeClient(c.node_procs[0].address, cluster_key=None).list_blobs()


def active_transfers(c) -> list[dict]:
    from celery import Celery

    app = Celery(broker=c.redis_url)
    try:
        active = app.control.inspect(timeout=1).active() or {}
    finally:
        app.close()
    return [t for tasks in active.values() for t in tasks if t["name"] == "smoltorrent.transfer"]


def stalled_store(c, tmp_path):
    """(With SMOLTORRENT_CHAIN=0: one transfer task per replica.) A store whose transfer
    to node 1 hangs: the node is frozen (SIGSTOP), so its kernel
    accepts the connection but nothing ever answers. Returns that transfer's active task."""
    src = make_ckpt(tmp_path / "s.safetensors")
    frozen = c.node_procs[1]
    frozen_id = NodeClient(frozen.address).ping()
    frozen.send_signal(signal.SIGSTOP)
    c.cli("store", str(src), "--shards", "1", "--no-wait")

    def hung_transfer():
        return [t for t in active_transfers(c) if t["kwargs"]["node_id"] == frozen_id]

    hung = wait_until(hung_transfer, timeout=30, what="the transfer to the frozen node")
    return src, frozen, hung[0]


def test_worker_lost_past_its_retries_is_a_dead_letter(make_cluster, tmp_path):
    c = make_cluster(2, retries=0, SMOLTORRENT_CHAIN="0")
    src, frozen, hung = stalled_store(c, tmp_path)
    os.kill(hung["worker_pid"], signal.SIGKILL)  # the pool child running the transfer
    letters = wait_until(lambda: c.cli_json("dlq", "ls"), timeout=30, what="a dead letter")
    assert letters[0]["task_id"] == hung["id"]
    assert "WorkerLostError" in letters[0]["error"]
    row = wait_until(lambda: committed(c, "s.safetensors"), timeout=30, what="commit")[0]
    assert row["under_replicated"] == [0]  # the other replica landed; this one is missing
    frozen.send_signal(signal.SIGCONT)
    c.cli("dlq", "replay", hung["id"])
    wait_until(
        lambda: committed(c, "s.safetensors")[0]["min_copies"] == 2,
        timeout=60,
        what="the replayed replica",
    )


def test_hard_time_limit_is_a_dead_letter(make_cluster, tmp_path):
    """A transfer that cannot even handle its soft limit (its process is frozen) is killed
    by the hard one, and that too is a dead letter."""
    base = 20  # soft limit at 10 s, hard at 20 s: time enough to freeze it before the soft
    c = make_cluster(
        2, retries=0, SMOLTORRENT_TRANSFER_TIME_BASE_S=str(base), SMOLTORRENT_CHAIN="0"
    )
    src, frozen, hung = stalled_store(c, tmp_path)
    running_for = time.time() - hung["time_start"]
    assert running_for < base // 2, f"found {running_for:.1f} s in: the soft limit may have fired"
    os.kill(hung["worker_pid"], signal.SIGSTOP)  # deaf to the soft limit's signal
    letters = wait_until(lambda: c.cli_json("dlq", "ls"), timeout=60, what="a dead letter")
    assert letters[0]["task_id"] == hung["id"]
    assert letters[0]["error"].startswith("TimeLimitExceeded"), letters[0]["error"]
    frozen.send_signal(signal.SIGCONT)


def test_store_without_a_worker_says_how_to_start_one(make_cluster, tmp_path):
    c = make_cluster(2, worker=False)
    src = make_ckpt(tmp_path / "w.safetensors")
    proc = c.cli("store", str(src), check=False)
    assert proc.returncode == 1
    assert "smoltorrent worker" in proc.stderr
    assert c.md.versions.names() == []  # nothing was queued or recorded


def test_worker_lost_with_retries_left_is_retried_and_commits(make_cluster, tmp_path):
    c = make_cluster(2, retries=3, SMOLTORRENT_CHAIN="0")
    src, frozen, hung = stalled_store(c, tmp_path)
    os.kill(hung["worker_pid"], signal.SIGKILL)
    frozen.send_signal(signal.SIGCONT)
    row = wait_until(lambda: committed(c, "s.safetensors"), timeout=60, what="commit")[0]
    assert row["min_copies"] == 2 and c.cli_json("dlq", "ls") == []
    frozen_id = hung["kwargs"]["node_id"]
    done = [
        a
        for a in c.md.transfers.attempts(row["vkey"])
        if a.get("result") and a["node"] == frozen_id
    ]
    assert done and done[-1]["attempt"] >= 1  # it ran again as a counted retry
