"""A node's repair pushes (replicate) between real node processes: paced at the rate the
coordinator names, on one bucket the node's sessions share (issue 37: the repair limit is
bytes per second per node, not a count of copies); several blobs to one peer in one
session (replicate_batch), each verified there, one's failure no other's."""

from __future__ import annotations

import hashlib
import os
import threading
import time

from smoltorrent import defaults
from tests.nodeproc import NodeProcess, node_metric
from tests.worker_server.conftest import CLUSTER_KEY

RATE = 1_000_000  # bytes/s: slow enough that three pushes of 1 MiB take seconds
BLOB_BYTES = 1 << 20


def test_repair_pushes_from_one_node_keep_to_its_rate_together(node_factory, make_blob):
    source, target = node_factory("source"), node_factory("target")
    blobs = [make_blob(BLOB_BYTES) for _ in range(3)]
    for blob in blobs:
        assert blob.put(source.client())
    outcomes: dict[str, bool] = {}

    def push(digest: str) -> None:
        outcomes[digest] = source.client(timeout=30).replicate(digest, target.address, RATE)

    # Three sessions at once, as three repair tasks would ask: the node's one bucket paces
    # them together, so they move no faster than one push at that rate would.
    threads = [threading.Thread(target=push, args=(b.digest,)) for b in blobs]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started

    assert outcomes == {b.digest: True for b in blobs}
    assert target.client().verify([b.digest for b in blobs]) == []
    # A lower bound, which a rate limiter guarantees whatever the machine's load: every
    # byte paid to the bucket, less the one burst it lets through after an idle spell.
    total = sum(len(b.content) for b in blobs)
    assert elapsed >= total / RATE - defaults.BWLIMIT_BURST_S, elapsed


def test_a_push_without_a_rate_is_not_paced_and_still_verified(node_factory, make_blob):
    source, target = node_factory("source"), node_factory("target")
    blob = make_blob(BLOB_BYTES)
    assert blob.put(source.client())
    assert source.client().replicate(blob.digest, target.address) is True
    assert source.client().replicate(blob.digest, target.address, RATE) is False  # held
    assert target.client().verify([blob.digest]) == []


def test_a_batch_copies_every_blob_over_one_session_and_a_bad_one_spoils_no_other(
    tmp_path, make_blob
):
    env = dict(os.environ, SMOLTORRENT_METRICS_PORT="0")
    source = NodeProcess(tmp_path / "source", CLUSTER_KEY, env=env).start()
    target = NodeProcess(tmp_path / "target", CLUSTER_KEY, env=env).start()
    try:
        blobs = [make_blob(BLOB_BYTES // 4 + i) for i in range(6)]
        for blob in blobs:
            assert blob.put(source.client())
        held, rotten = blobs[0], blobs[3]
        assert held.put(target.client())  # the target has this one already
        # Rotten in place on the source, same size: the target's hash refuses it.
        path = source.data_dir / "blobs" / rotten.digest[:2] / rotten.digest
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        absent = hashlib.sha256(b"a blob the source never had").hexdigest()
        digests = [b.digest for b in blobs[:3]] + [absent] + [b.digest for b in blobs[3:]]
        before = node_metric(target, "smoltorrent_node_connections_accepted_total")

        outcomes = source.client(timeout=30).replicate_batch(digests, target.address, RATE * 4)

        good = [b.digest for b in blobs if b not in (held, rotten)]
        assert outcomes == {
            **{d: "stored" for d in good},
            held.digest: "exists",
            absent: "missing",
            rotten.digest: "mismatch",
        }
        # One session carried them all, the mismatch included.
        assert node_metric(target, "smoltorrent_node_connections_accepted_total") - before == 1
        on_target = set(target.client().list_blobs())
        assert on_target == {held.digest, *good}
        assert target.client().verify(sorted(on_target)) == []  # each SHA-256 checked again
    finally:
        source.kill()
        target.kill()


def test_a_batch_to_a_peer_that_cannot_be_reached_fails_every_blob_once(node_factory, make_blob):
    source, gone = node_factory("source"), node_factory("gone")
    blobs = [make_blob(1000 + i) for i in range(3)]
    for blob in blobs:
        assert blob.put(source.client())
    address = gone.address
    gone.kill()
    outcomes = source.client(timeout=30).replicate_batch([b.digest for b in blobs], address)
    assert set(outcomes) == {b.digest for b in blobs}
    assert all(how.startswith("failed: cannot reach peer") for how in outcomes.values())
