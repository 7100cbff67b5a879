"""Repair and trim tasks on a real worker: each one sent twice (a retry, a redelivery, two
beats) leaves the same state as one clean run."""

from __future__ import annotations

from collections import Counter

from celery import Celery

from coordinator.state import repairs
from coordinator.state.repair_plan import TRIM
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_blobs_ckpt, make_ckpt


def send(c, name: str, kwargs: dict, task_id: str):
    app = Celery(broker=c.redis_url, backend=c.redis_url)
    try:
        return app.send_task(name, kwargs=kwargs, task_id=task_id, queue="control")
    finally:
        app.close()


def copies(c, digest: str) -> int:
    return Counter(d for n in c.node_procs for d in n.client().list_blobs())[digest]


def test_a_repair_sent_twice_makes_one_copy_and_a_trim_sent_twice_keeps_r(make_cluster, tmp_path):
    c = make_cluster(3)
    src = make_ckpt(tmp_path / "twice.safetensors")
    c.cli("store", str(src), "--name", "twice.safetensors")
    md = c.md
    digest = md.versions.manifest(md.versions.current("twice.safetensors")).entries[0].blob_sha256
    by_id = {n.client().ping(): n for n in c.node_procs}
    holders = sorted(md.blobs.placement(digest))
    (target,) = set(by_id) - set(holders)
    kwargs = {"digest": digest, "source": holders[0], "target": target}
    results = [send(c, "smoltorrent.repair", kwargs, f"repair-{digest}-{target}") for _ in range(2)]
    outcomes = {r.get(timeout=60) for r in results}
    assert outcomes <= {"stored", "exists"}
    assert md.blobs.placement(digest) == {*holders, target}
    # One per node: the second run found the first's copy. The repair's end plans the next
    # step, and the blob is one copy above its R now: that trim may have deleted one already.
    assert copies(c, digest) in (2, 3)
    # No copy in flight; a trim may be: each repair's end plans the next step, and the
    # blob is one copy above its R now.
    assert [r for r in repairs.in_flight(md) if r.target != TRIM] == []

    trims = [
        send(c, "smoltorrent.trim", {"digest": digest, "replicas": 2}, f"trim-{digest}")
        for _ in range(2)
    ]
    for t in trims:
        t.get(timeout=60)
    wait_until(lambda: copies(c, digest) == 2, timeout=30, what="one surplus copy deleted")
    # Every copy left on disk is in the placement. Not asserted: that the placement holds
    # only those. The second repair (this test's duplicate) may count its target's copy
    # (repairs/placed) after a trim its twin's end planned deleted it, leaving a placement
    # entry with no copy until the crosscheck (2026-12-06 CI, 1 run in 5: 3 against 2).
    on_disk = {i for i, n in by_id.items() if digest in n.client().list_blobs()}
    assert len(on_disk) == 2 and on_disk <= md.blobs.placement(digest)
    for node_id in on_disk:
        assert by_id[node_id].client().verify([digest]) == []


def test_a_repair_session_copies_its_blobs_together_and_a_bad_source_copy_spoils_no_other(
    make_cluster, tmp_path
):
    c = make_cluster(3)
    src = make_blobs_ckpt(tmp_path / "many.safetensors", 9)
    c.cli("store", str(src), "--name", "many.safetensors")
    md = c.md
    entries = md.versions.manifest(md.versions.current("many.safetensors")).entries
    by_id = {n.client().ping(): n for n in c.node_procs}
    held = {e.blob_sha256: md.blobs.placement(e.blob_sha256) for e in entries}
    # The pair with the most blobs the source holds and the target lacks.
    source, target = max(
        ((s, t) for s in by_id for t in by_id if s != t),
        key=lambda st: sum(st[0] in h and st[1] not in h for h in held.values()),
    )
    digests = sorted(d for d, h in held.items() if source in h and target not in h)
    assert len(digests) >= 3, held
    rotten = digests[1]
    path = by_id[source].data_dir / "blobs" / rotten[:2] / rotten
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # rotten in place, same size: only a hash tells
    path.write_bytes(bytes(data))
    kwargs = {"digest": digests[0], "source": source, "target": target, "more": digests[1:]}

    outcomes = send(c, "smoltorrent.repair", kwargs, f"repair-{digests[0]}-{target}").get(60)

    assert outcomes == {d: "source-bad" if d == rotten else "stored" for d in digests}
    assert repairs.counts(md)["repaired"] >= len(digests) - 1
