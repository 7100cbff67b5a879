"""Chunks delivered in batches: the chunks of a chunked version whose chains go to the same
nodes share a chain task (tasks/chain_batches.py). Real redis-server, Celery worker, node
processes and CLI; the reconcile test reads the messages reconcile queues off the broker."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

from coordinator.cli.output import numbers as chunk_ranges
from coordinator.dataplane.chunk_engine import prepare_chunked_store
from coordinator.plan.chains import chain_order
from coordinator.plan.manifest import Manifest
from coordinator.state.versions import COMMITTED
from smoltorrent import defaults
from tests.nodeproc import node_metric
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import committed, sha

MIB = 1024 * 1024


def many_chunks(path: Path, chunks: int) -> Path:
    """A checkpoint of `chunks` random 1 MiB U8 tensors: a chunk each (CHUNK_SOLO_BYTES)."""
    header = {
        f"layers.{i}.weight": {"dtype": "U8", "shape": [MIB], "data_offsets": [at, at + MIB]}
        for i, at in enumerate(range(0, chunks * MIB, MIB))
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _ in range(chunks):
            f.write(os.urandom(MIB))
    past = time.time() - 60
    os.utime(path, (past, past))
    return path


def pending_version(c, tmp_path, chunks: int) -> tuple[str, list, Manifest]:
    """A pending chunked version of `chunks` 1 MiB chunks, as a store task leaves it."""
    src = many_chunks(tmp_path / "pending.safetensors", chunks)
    free = {n: 10**12 for n in c.md.nodes.nodes()}
    prepared = prepare_chunked_store(src, src.name, free, tmp_path / "spool", encode=False)
    manifest, vkey = prepared.manifest, prepared.vkey
    targets = chain_order(list(prepared.targets), [e.blob_size for e in manifest.entries])
    identity = json.dumps(prepared.identity.to_dict())
    fields = {"path": str(src), "host": c.host_id, "identity": identity}
    assert c.md.versions.create_pending(manifest, vkey, fields, targets) == "created"
    c.md.transfers.keep_spans(vkey, prepared.spans)
    return vkey, targets, manifest


def chain_task_ids(cluster) -> set[str]:
    return set(re.findall(r"Task smoltorrent\.chain\[([^\]]+)\] received", cluster.worker_log()))


def test_a_chunked_store_sends_a_chain_task_per_batch_of_chunks(make_cluster, tmp_path):
    c = make_cluster(4)
    src = many_chunks(tmp_path / "many.safetensors", 48)
    row = c.cli_json("store", str(src))
    assert row["state"] == COMMITTED and row["min_copies"] == 2
    manifest = c.md.versions.manifest(row["vkey"])
    assert len(manifest.chunks) == 48
    tasks = chain_task_ids(c)
    # A task per batch, not per chunk; still enough that every pool process gets work.
    assert defaults.CHAIN_BATCH_MIN_TASKS <= len(tasks) <= len(manifest.chunks) // 2, tasks
    assert c.md.transfers.settled(row["vkey"]) == {f"{i}:{r}" for i in range(48) for r in (0, 1)}
    for chunk in manifest.chunks:
        assert len(c.md.blobs.placement(chunk.blob_sha256)) == 2
    attempts = [a for a in c.md.transfers.attempts(row["vkey"]) if "result" in a]
    assert sorted((a["shard"], a["replica"]) for a in attempts) == [
        (i, r) for i in range(48) for r in (0, 1)
    ]
    out = tmp_path / "out.safetensors"
    c.cli("gather", "many.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_one_copy_store_sends_its_chunks_in_batches_too(make_cluster, tmp_path):
    """R=1: each chunk's chain is its one node, and the chunks going to the same node share
    a task as chains do (a transfer task per chunk cost more in dispatch than its chunk
    took to move)."""
    c = make_cluster(4)
    src = many_chunks(tmp_path / "one.safetensors", 48)
    row = c.cli_json("store", str(src), "--replicas", "1")
    assert row["state"] == COMMITTED and row["min_copies"] == 1
    log = c.worker_log()
    assert "Task smoltorrent.transfer[" not in log
    tasks = chain_task_ids(c)
    assert defaults.CHAIN_BATCH_MIN_TASKS <= len(tasks) <= 48 // 2, tasks
    assert c.md.transfers.settled(row["vkey"]) == {f"{i}:0" for i in range(48)}
    manifest = c.md.versions.manifest(row["vkey"])
    for chunk in manifest.chunks:
        assert len(c.md.blobs.placement(chunk.blob_sha256)) == 1
    out = tmp_path / "out.safetensors"
    c.cli("gather", "one.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_without_chain_replication_every_copy_comes_from_the_source_in_batches(
    make_cluster, tmp_path
):
    """SMOLTORRENT_CHAIN=0 (nodes that cannot reach each other): every copy of a chunk is
    sent from the coordinator, as a chain of its one node, and a node's copies share
    tasks (one transfer task per chunk and replica before)."""
    c = make_cluster(4, SMOLTORRENT_CHAIN="0")
    src = many_chunks(tmp_path / "direct.safetensors", 24)
    row = c.cli_json("store", str(src))
    assert row["state"] == COMMITTED and row["min_copies"] == 2
    assert "Task smoltorrent.transfer[" not in c.worker_log()
    assert len(chain_task_ids(c)) <= 24
    settled = {f"{i}:{r}" for i in range(24) for r in (0, 1)}
    assert c.md.transfers.settled(row["vkey"]) == settled
    attempts = [a for a in c.md.transfers.attempts(row["vkey"]) if "result" in a]
    assert sorted((a["shard"], a["replica"]) for a in attempts) == sorted(
        (i, r) for i in range(24) for r in (0, 1)
    )
    assert {a["result"] for a in attempts} == {"sent"}  # none passed on by a node
    out = tmp_path / "out.safetensors"
    c.cli("gather", "direct.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_batch_whose_node_is_gone_dead_letters_every_chunk_and_replays(make_cluster, tmp_path):
    """Two nodes, R=2, one dead: no chunk's second copy has anywhere to go, so each batch
    retries, then dead-letters with every chunk it carries; each of those chunks settles as
    failed, so the version commits on the copies that landed, and the replay completes it."""
    c = make_cluster(2, retries=1)
    src = many_chunks(tmp_path / "gone.safetensors", 12)
    dead = c.node_procs[1]
    dead_id = dead.client().ping()
    dead.kill()
    c.cli("store", str(src), check=False)
    row = wait_until(lambda: committed(c, "gone.safetensors"), 120, what="the commit")[0]
    assert row["under_replicated"] == list(range(12))
    letters = c.cli_json("dlq", "ls")
    assert {letter["task"] for letter in letters} == {"smoltorrent.chain"}
    assert all(dead_id in letter["node"] for letter in letters)
    kwargs = [letter["kwargs"] for letter in letters]
    carried = [e["shard"] for k in kwargs for e in [k, *k.get("more", [])]]
    assert len(letters) < 12 and sorted(carried) == list(range(12))  # batches, every chunk
    # Each letter names every chunk it carries, not just its first (dlq ls's chunks column).
    assert sorted(n for letter in letters for n in letter["shards"]) == list(range(12))
    assert all(letter["shard"] == letter["shards"][0] for letter in letters)
    listed = c.cli("dlq", "ls").stdout
    assert all(chunk_ranges(letter["shards"]) in listed for letter in letters)
    dead.start()
    c.cli("dlq", "replay", "--all")
    wait_until(
        lambda: committed(c, "gone.safetensors")[0]["min_copies"] == 2,
        timeout=120,
        what="the replayed copies",
    )
    out = tmp_path / "out.safetensors"
    c.cli("gather", "gone.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


# Run with the cluster's environment (tasks.app reads its broker from it at import): one
# reconcile of the version, then the messages it queued, read back off the broker's list
# as the sweep reads them, and what they hold for it.
RECONCILE = """
import json, sys
from beat.reconcile import execute, held, queued
from coordinator import config
from coordinator.state.reconcile import Actions
from tasks.app import app
from tasks.context import metadata

vkey, host = sys.argv[1], sys.argv[2]
execute(metadata(), Actions(transfers=[vkey]))
with app.connection_for_read() as connection:
    calls = queued(connection.default_channel, [config.transfer_queue(host)])
print(json.dumps({
    "calls": [[name, task_id, kwargs] for name, task_id, _, kwargs in calls],
    "held": sorted(shard for key, shard in held(calls).shards if key == vkey),
}))
"""


def test_reconcile_resends_only_the_unsettled_chunks_of_a_batch_and_holds_them(
    make_cluster, tmp_path
):
    """A store that died with 10 chunks settled and one chunk half settled: reconcile sends
    the rest again, batched, and only the replicas still unsettled; a queued batch holds
    every chunk it carries, so the next pass does not send them a second time."""
    c = make_cluster(4, worker=False)
    vkey, targets, manifest = pending_version(c, tmp_path, 40)
    for i in range(10):
        for r, node in enumerate(targets[i]):
            c.md.transfers.settle(vkey, i, r, node, manifest.entries[i].blob_sha256)
    c.md.transfers.settle(vkey, 10, 0, targets[10][0], manifest.entries[10].blob_sha256)

    found = subprocess.run(
        [sys.executable, "-c", RECONCILE, vkey, c.host_id],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr
    sent = json.loads(found.stdout)
    sent_pairs = []
    for name, task_id, kwargs in sent["calls"]:
        entries = [kwargs, *kwargs.get("more", [])]
        if name == "smoltorrent.chain":
            assert task_id.startswith(f"chain-{vkey}-{entries[0]['shard']}-")
            sent_pairs += [(e["shard"], r) for e in entries for r in e["replicas"]]
        else:  # the half-settled chunk: one replica left, a transfer of its own
            assert name == "smoltorrent.transfer"
            sent_pairs.append((kwargs["shard"], kwargs["replica"]))
    assert sorted(sent_pairs) == [(10, 1)] + [(i, r) for i in range(11, 40) for r in (0, 1)]
    chains = [call for call in sent["calls"] if call[0] == "smoltorrent.chain"]
    assert len(chains) < 29  # batched: fewer tasks than chunks
    assert sent["held"] == list(range(10, 40))


ACCEPTED = "smoltorrent_node_connections_accepted_total"


def test_a_chain_task_keeps_its_connections_down_its_chain(make_cluster, tmp_path):
    """A batch's chunks go to the first node of their chain over one kept connection, and
    from it to the next node over one kept link: a new one per chunk cost a TCP connect,
    the handshake and a thread on the node, 282 times per hop in a 1 GB store."""
    c = make_cluster(4, SMOLTORRENT_METRICS_PORT="0")
    src = many_chunks(tmp_path / "kept.safetensors", 48)
    before = sum(node_metric(n, ACCEPTED) for n in c.node_procs)
    row = c.cli_json("store", str(src))
    opened = sum(node_metric(n, ACCEPTED) for n in c.node_procs) - before
    assert row["state"] == COMMITTED and row["min_copies"] == 2
    tasks = chain_task_ids(c)
    assert len(tasks) < 48
    # At most one head connection and one node-to-node link per task, and the store's
    # own calls around them (probes, the manifest's copies): far under one per chunk.
    print(f"{opened} connections for 48 chunks in {len(tasks)} tasks")
    assert opened < 2 * len(tasks) + 20, opened
    out = tmp_path / "out.safetensors"
    c.cli("gather", "kept.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
