"""Chain replication through Celery (the default for R >= 2): real Redis, worker, nodes, CLI."""

from __future__ import annotations

import signal
import urllib.request

from coordinator.state.versions import COMMITTED
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import committed, make_blobs_ckpt, make_ckpt, sha


def node_counter(node, name: str) -> float:
    port = (node.data_dir / "metrics_port").read_text().strip()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    return float(next(x for x in text.splitlines() if x.startswith(name)).split()[-1])


def test_chain_store_sends_every_byte_once_from_the_coordinator(make_cluster, tmp_path):
    c = make_cluster(4, SMOLTORRENT_METRICS_PORT="0")
    src = make_ckpt(tmp_path / "a.safetensors")
    row = c.cli_json("store", str(src), "--shards", "4")
    assert row["state"] == COMMITTED and row["min_copies"] == 2
    blob_bytes = sum(s.blob_size for s in c.md.versions.manifest(row["vkey"]).entries)
    received = [node_counter(n, "smoltorrent_node_bytes_received_total") for n in c.node_procs]
    sent = [node_counter(n, "smoltorrent_node_bytes_sent_total") for n in c.node_procs]
    assert sum(received) == 2 * blob_bytes  # two verified copies of every blob
    # The nodes passed one copy on to each other: the coordinator's link carried the other.
    assert sum(received) - sum(sent) == blob_bytes
    assert all(s > 0 for s in sent), sent  # every node heads a chain: outbound links shared
    results = {a["result"] for a in c.md.transfers.attempts(row["vkey"]) if "result" in a}
    assert results == {"sent", "replicated"}
    out = tmp_path / "out.safetensors"
    c.cli("gather", "a.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_three_copies_by_chain(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "r3.safetensors")
    row = c.cli_json("store", str(src), "--replicas", "3", "--shards", "2")
    assert row["state"] == COMMITTED and row["min_copies"] == 3
    for shard in c.md.versions.manifest(row["vkey"]).entries:
        assert len(c.md.blobs.placement(shard.blob_sha256)) == 3
    c.node_procs[0].kill()
    out = tmp_path / "out.safetensors"
    c.cli("gather", "r3.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_silent_node_is_replaced_not_waited_for(make_cluster, tmp_path):
    """A node that stops answering mid-store (SIGSTOP: its kernel still accepts connections,
    nothing answers, as a hung Pi) loses its replicas to the other live nodes: the store
    ends at R=2 on the survivors with no retry to wait out and no dead letter."""
    c = make_cluster(4, retries=2, SMOLTORRENT_SOCKET_TIMEOUT_S="2")
    frozen = c.node_procs[1]
    frozen_id = frozen.client().ping()
    src = make_ckpt(tmp_path / "s.safetensors", 8_000_000)
    frozen.send_signal(signal.SIGSTOP)  # still counted alive: shards are placed on it
    try:
        row = c.cli_json("store", str(src), "--shards", "4")
        assert row["state"] == COMMITTED, row
        assert row["min_copies"] == 2 and row["under_replicated"] == []
        assert c.cli_json("dlq", "ls") == []
        manifest = c.md.versions.manifest(row["vkey"])
        planned_on_frozen = [
            i for i, t in enumerate(c.md.transfers.plan(row["vkey"])) if frozen_id in t
        ]
        assert planned_on_frozen == []  # the plan names the replacements
        for shard in manifest.entries:
            holders = c.md.blobs.placement(shard.blob_sha256)
            assert len(holders) == 2 and frozen_id not in holders
        moved = [a for a in c.md.transfers.attempts(row["vkey"]) if a.get("node") == frozen_id]
        assert moved and all("error" in a for a in moved)  # it was tried, then replaced
        assert all(
            a["attempt"] == 0 for a in c.md.transfers.attempts(row["vkey"])
        )  # no retry needed
    finally:
        frozen.send_signal(signal.SIGCONT)
    out = tmp_path / "out.safetensors"
    c.cli("gather", "s.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_node_one_transfer_could_not_reach_is_passed_over_by_the_others(make_cluster, tmp_path):
    """A chunked store has a transfer per chunk. Once one of them gives up a silent node
    (SIGSTOP: the connection opens, nothing answers), the others place their copies on
    the live nodes at once instead of each waiting out the same timeout: only the
    transfers already running when it was found tried it. Before, every chunk planned on
    it waited its 2 s. Once the node answers a probe again, stores place on it again."""
    c = make_cluster(4, SMOLTORRENT_SOCKET_TIMEOUT_S="2")
    frozen = c.node_procs[1]
    frozen_id = frozen.client().ping()
    src = make_blobs_ckpt(tmp_path / "many.safetensors", 32)
    frozen.send_signal(signal.SIGSTOP)  # still counted alive: chunks are placed on it
    try:
        row = c.cli_json("store", str(src))
        assert row["state"] == COMMITTED and row["under_replicated"] == [], row
        tried = {
            a["shard"] for a in c.md.transfers.attempts(row["vkey"]) if a.get("node") == frozen_id
        }
        assert tried, "the plan put no chunk on the silent node: the test shows nothing"
        assert len(tried) <= 4, tried  # the worker's 4 processes, no more
        for chunk in c.md.versions.manifest(row["vkey"]).entries:
            assert frozen_id not in c.md.blobs.placement(chunk.blob_sha256)
        assert c.md.nodes.unreachable([frozen_id]) == {frozen_id}
    finally:
        frozen.send_signal(signal.SIGCONT)
    again = c.cli_json("store", str(make_blobs_ckpt(tmp_path / "next.safetensors", 16)))
    assert again["state"] == COMMITTED
    holders = set().union(
        *(
            c.md.blobs.placement(e.blob_sha256)
            for e in c.md.versions.manifest(again["vkey"]).entries
        )
    )
    assert frozen_id in holders  # its probe answered: no longer passed over
    out = tmp_path / "out.safetensors"
    c.cli("gather", "many.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_with_no_node_to_take_it_a_lost_replica_retries_then_dead_letters(make_cluster, tmp_path):
    """Two nodes, R=2, one dead: no other node can take its replica, so it retries and
    dead-letters as a transfer does; the version commits on the copy that landed."""
    c = make_cluster(2, retries=1)
    src = make_ckpt(tmp_path / "d.safetensors")
    dead_id = c.node_procs[1].client().ping()
    c.node_procs[1].kill()
    c.cli("store", str(src), "--shards", "1", check=False)
    letters = wait_until(lambda: c.cli_json("dlq", "ls"), timeout=60, what="a dead letter")
    assert letters[0]["task"] == "smoltorrent.chain" and dead_id in letters[0]["node"]
    row = wait_until(lambda: committed(c, "d.safetensors"), timeout=60, what="commit")[0]
    assert row["under_replicated"] == [0]
    c.node_procs[1].start()
    c.cli("dlq", "replay", "--all")
    wait_until(
        lambda: committed(c, "d.safetensors")[0]["min_copies"] == 2,
        timeout=60,
        what="the replayed replica",
    )
