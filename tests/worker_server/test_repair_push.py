"""A node's repair pushes (replicate) between real node processes: paced at the rate the
coordinator names, on one bucket the node's sessions share (issue 37: the repair limit is
bytes per second per node, not a count of copies)."""

from __future__ import annotations

import threading
import time

from smoltorrent import defaults

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
