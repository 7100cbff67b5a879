"""Metadata on a real redis-server (started here, on a free port, in a temp dir)."""

from __future__ import annotations

import os
import signal

import pytest

from bench.scale_metadata import CountedMetadata
from coordinator.dataplane.store_engine import PreparedStore, prepare_store
from coordinator.local.synthetic import synthetic_manifest, write_checkpoint
from coordinator.plan.manifest import VersionBlobs, storage_key
from coordinator.state import redis_keys as K
from coordinator.state import repairs, trim_marks
from coordinator.state.embedded_redis import start_redis, url_for
from coordinator.state.metadata import COMMITTED, Metadata
from coordinator.state.repair_plan import wanted_blobs
from smoltorrent import defaults

FREE = {"node-a": 10**12, "node-b": 10**12}


@pytest.fixture
def md(tmp_path):
    pid, port = start_redis(tmp_path / "redis")
    yield Metadata(url_for(tmp_path / "redis", port))
    os.kill(pid, signal.SIGTERM)


def prepared(tmp_path, name: str, seed: int) -> PreparedStore:
    path = tmp_path / f"{name.replace('/', '_')}-{seed}.safetensors"
    write_checkpoint(path, 200_000 + seed, hidden=32)
    return prepare_store(path, name, FREE, replicas=2, shards=2)


def pending(md: Metadata, p: PreparedStore, task_id: str = "t1") -> bool:
    """Record the version a new store request asks for; True if it was created."""
    found = md.create_pending(p.manifest, p.vkey, {"request_id": task_id}, list(p.targets))
    return found == "created"


def settle_all(md: Metadata, p: PreparedStore) -> None:
    for shard, nodes in enumerate(p.targets):
        for replica, node in enumerate(nodes):
            md.settle(p.vkey, shard, replica, node, p.manifest.shards[shard].blob_sha256)


def test_the_barrier_fires_once_and_only_when_every_transfer_settled(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 1)
    assert pending(md, p) is True
    assert pending(md, p, "t2") is False  # the same bytes again: one version
    digests = [s.blob_sha256 for s in p.manifest.shards]
    fired = [
        md.settle(p.vkey, 0, 0, "node-a", digests[0]),
        md.settle(p.vkey, 0, 1, None, digests[0]),  # a dead replica still settles
        md.settle(p.vkey, 1, 0, "node-b", digests[1]),
        md.settle(p.vkey, 1, 1, "node-a", digests[1]),
    ]
    assert fired == [False, False, False, True]
    # Until the commit is queued, a redelivery of the last transfer fires again (the
    # commit is idempotent); once it is queued, never.
    assert md.settle(p.vkey, 1, 1, "node-a", digests[1]) is True
    md.mark_commit_enqueued(p.vkey)
    assert md.settle(p.vkey, 1, 1, "node-a", digests[1]) is False
    assert md.placement(digests[0]) == {"node-a"}
    assert md.ready_shards(p.vkey) == {0, 1}


def test_a_shard_with_no_copy_holds_the_barrier_until_its_replay_succeeds(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 2)
    pending(md, p)
    d = [s.blob_sha256 for s in p.manifest.shards]
    assert not md.settle(p.vkey, 0, 0, "node-a", d[0])
    assert not md.settle(p.vkey, 0, 1, "node-b", d[0])
    assert not md.settle(p.vkey, 1, 0, None, d[1])
    assert not md.settle(p.vkey, 1, 1, None, d[1])  # all settled, shard 1 has no copy
    assert md.settle(p.vkey, 1, 0, "node-a", d[1]) is True  # the replayed transfer


def test_an_older_version_committing_late_does_not_become_current(md, tmp_path):
    old, new = prepared(tmp_path, "latest", 3), prepared(tmp_path, "latest", 4)
    pending(md, old)  # accepted first: the lower sequence number
    pending(md, new)
    assert md.commit(new.vkey, "latest") is True
    assert md.commit(old.vkey, "latest") is False
    assert md.current("latest") == new.vkey
    assert md.version(old.vkey)["state"] == COMMITTED  # still gatherable by version
    assert md.begin_remove(new.vkey) == COMMITTED
    assert md.current("latest") == old.vkey  # the newest remaining committed one


def test_dead_letters_are_recorded_listed_and_removed(md):
    md.add_dead_letter("transfer-x-0-1", {"task": "smoltorrent.transfer", "error": "boom"})
    md.add_dead_letter("transfer-x-1-1", {"task": "smoltorrent.transfer", "error": "bang"})
    assert [r["task_id"] for r in md.dead_letters()] == ["transfer-x-0-1", "transfer-x-1-1"]
    assert md.dead_letter_depth() == 2
    md.remove_dead_letter("transfer-x-0-1")
    assert md.dead_letter("transfer-x-1-1")["error"] == "bang"
    assert md.r.xlen("smoltorrent:dlq:stream") == 2  # the index keeps the history


def test_a_store_of_older_bytes_makes_their_version_current_again(md, tmp_path):
    """A, B, A under one name: training rolled back and re-saved; the name serves A."""
    a, b = prepared(tmp_path, "run/latest", 5), prepared(tmp_path, "run/latest", 6)
    pending(md, a)
    md.commit(a.vkey, "run/latest")
    pending(md, b)
    md.commit(b.vkey, "run/latest")
    assert md.current("run/latest") == b.vkey
    assert pending(md, a) is False  # no bytes move: the version exists, committed
    assert md.current("run/latest") == a.vkey
    assert md.versions("run/latest") == [b.vkey, a.vkey]  # ordered by latest request


def test_a_rollback_while_both_are_pending_ends_on_the_latest_request(md, tmp_path):
    a, b = prepared(tmp_path, "x", 7), prepared(tmp_path, "x", 8)
    pending(md, a)
    pending(md, b)
    pending(md, a)  # A asked for again before either committed
    md.commit(a.vkey, "x")
    assert md.commit(b.vkey, "x") is False
    assert md.current("x") == a.vkey


def test_a_late_transfer_never_changes_a_committed_versions_state(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 9)
    pending(md, p)
    settle_all(md, p)
    assert md.commit(p.vkey, "ckpt") is True
    digest = p.manifest.shards[0].blob_sha256
    assert md.abort(p.vkey, "a late transfer saw the source change") is False
    assert md.settle(p.vkey, 0, 1, "node-c", digest) is False  # a dead-letter replay
    assert md.version(p.vkey)["state"] == COMMITTED
    assert "node-c" in md.placement(digest)  # ... which still adds its replica


def test_a_removed_version_is_never_committed_nor_made_current(md, tmp_path):
    p = prepared(tmp_path, "gone", 10)
    pending(md, p)
    settle_all(md, p)
    assert md.begin_remove(p.vkey) == "pending"
    digest = p.manifest.shards[0].blob_sha256
    before = md.placement(digest)
    assert md.settle(p.vkey, 0, 0, "node-z", digest) is False
    assert md.placement(digest) == before  # a removing version records nothing
    assert md.commit(p.vkey, "gone") is False
    assert md.current("gone") is None and md.version(p.vkey)["state"] == "removing"
    assert md.finish_remove(p.vkey) is True
    assert md.commit(p.vkey, "gone") is False
    assert md.current("gone") is None and md.version(p.vkey)["state"] == "removed"
    assert md.versions("gone") == [] and md.names() == []
    assert md.r.ttl(f"smoltorrent:version:{p.vkey}") > 0  # the tombstone expires
    assert md.restore_committed(p.manifest, p.vkey) is False  # rebuild leaves it gone
    assert pending(md, p) is True  # storing the same bytes again starts afresh


def test_requests_take_one_counter_and_close_once(md):
    first = md.open_request("r1", "store", "host-a", {"path": "/x"})
    second = md.open_request("r2", "gather", "host-a", {"vkey": "v"})
    assert second == first + 1
    assert [rid for rid, _ in md.open_requests()] == ["r1", "r2"]
    assert md.start_request("r1", "boot-1") == "queued"
    assert md.request("r1")["state"] == "running"
    md.finish_request("r1", "done", vkey="v1")
    assert md.start_request("r1", "boot-2") == "done"  # a re-drive does not run it again
    assert [rid for rid, _ in md.open_requests()] == ["r2"]
    assert md.r.ttl("smoltorrent:request:r1") > 0


def test_bookkeeping_is_bounded_once_settled(md, tmp_path):
    p = prepared(tmp_path, "bounded", 11)
    pending(md, p)
    for i in range(1200):
        md.record_attempt(p.vkey, {"shard": 0, "replica": 0, "node": "node-a", "attempt": i})
    assert len(md.attempts(p.vkey)) == 1000 and md.attempts(p.vkey)[-1]["attempt"] == 1199
    settle_all(md, p)
    md.commit(p.vkey, "bounded")
    assert md.r.ttl(f"smoltorrent:version:{p.vkey}:attempts") > 0
    md.add_dead_letter(f"transfer-{p.vkey}-0-1", {"task": "smoltorrent.transfer"})
    md.add_dead_letter("transfer-other-0-1", {"task": "smoltorrent.transfer"})
    assert md.begin_remove(p.vkey) == COMMITTED
    assert md.blobs_to_delete(p.vkey) == {s.blob_sha256 for s in p.manifest.shards}
    for s in p.manifest.shards:
        md.blob_deleted(p.vkey, s.blob_sha256, ["node-a", "node-b"])
        assert not md.r.exists(f"smoltorrent:blob:{s.blob_sha256}:nodes")  # placement gone
    assert md.drop_dead_letters_of(p.vkey) == 1
    assert md.finish_remove(p.vkey)
    assert [r["task_id"] for r in md.dead_letters()] == ["transfer-other-0-1"]
    leftovers = [k for k in md.r.scan_iter(f"smoltorrent:*{p.vkey}*")]
    assert leftovers == [f"smoltorrent:version:{p.vkey}"]  # the expiring tombstone only


def test_a_blob_shared_by_two_versions_is_deleted_only_with_the_last(md, tmp_path):
    p = prepared(tmp_path, "one", 12)
    twin = prepare_store(p.path, "two", FREE, replicas=2, shards=2)  # same bytes, other name
    pending(md, p)
    pending(md, twin)
    digests = {s.blob_sha256 for s in p.manifest.shards}
    assert md.blob_refs(next(iter(digests))) == {p.vkey, twin.vkey}
    md.begin_remove(p.vkey)
    assert md.blobs_to_delete(p.vkey) == set()
    md.begin_remove(twin.vkey)
    assert md.blobs_to_delete(twin.vkey) == digests
    assert all(md.blob_deleting(d) for d in digests)  # a store now waits, then re-sends


def committed_version(md: Metadata, tmp_path, name: str, seed: int) -> PreparedStore:
    p = prepared(tmp_path, name, seed)
    pending(md, p)
    md.commit(p.vkey, name)
    return p


def test_retire_spares_the_current_the_pending_the_read_and_the_newest_k(md, tmp_path):
    pa, pb, pc = (committed_version(md, tmp_path, "r", seed) for seed in (20, 21, 22))
    a, b, c = pa.vkey, pb.vkey, pc.vkey
    d = prepared(tmp_path, "r", 23)
    pending(md, d)  # being stored: the newest request of all
    assert md.retire(d.vkey, 1) == "pending"
    assert md.retire(c, 1) == "current"
    assert md.retire(b, 2) == "kept"  # c and b are the newest two committed
    # A gather reading b: retention waits for it, however old b is.
    assert md.start_reading(b, "host:1:task", 60) == COMMITTED
    assert md.readers(b) == ["host:1:task"]
    assert md.retire(b, 1) == "reading"
    md.stop_reading(b, "host:1:task")
    assert md.retire(b, 1) == "retired"
    assert md.state(b) == "removing"
    assert md.start_reading(b, "host:2:task", 60) == "removing"  # no gather starts now
    assert md.readers(b) == []
    # A store of a's bytes again (a rollback) makes it current: it stays, c goes.
    assert pending(md, pa) is False
    assert md.current("r") == a
    assert md.retire(a, 1) == "current"
    assert md.retire(c, 1) == "retired"
    # A mark that is not refreshed lapses (a gather killed mid-way blocks nothing for long).
    e = committed_version(md, tmp_path, "r", 24).vkey
    assert md.start_reading(a, "host:3:task", 0.001) == COMMITTED
    while md.readers(a):
        pass
    assert md.retire(a, 1) == "retired"
    assert md.current("r") == e


def test_retire_takes_an_aborted_version_only_under_a_newer_committed_one(md, tmp_path):
    old = prepared(tmp_path, "s", 30)
    pending(md, old)
    md.abort(old.vkey, "source changed")
    assert md.retire(old.vkey, 3) == "kept"  # its reason stays visible until a store lands
    committed_version(md, tmp_path, "s", 31)
    assert md.retire(old.vkey, 3) == "retired"
    assert md.blobs_to_delete(old.vkey) == {s.blob_sha256 for s in old.manifest.shards}


def test_live_workers_are_found_without_scanning_the_keyspace(md):
    md.worker_alive("host-a", "boot-1")
    md.worker_alive("host-b", "boot-2")
    md.r.delete("smoltorrent:worker:host-b:alive")  # its TTL ran out
    md.r.config_resetstat()
    assert md.worker_boots() == {"host-a": "boot-1"}
    assert "cmdstat_scan" not in md.r.info("commandstats")
    md.worker_alive("host-b", "boot-3")  # back
    assert md.worker_boots() == {"host-a": "boot-1", "host-b": "boot-3"}


def test_listed_copies_follow_every_placement_change(md, tmp_path):
    """The listing keeps a copy of each placement; every writer of a placement drops it in
    the same step, so `ls` never shows a stale copy count."""
    p = prepared(tmp_path, "listed", 40)
    pending(md, p)
    settle_all(md, p)
    md.commit(p.vkey, "listed")
    digest = p.manifest.shards[0].blob_sha256
    nodes = ["node-a", "node-b", "node-c", "node-d"]

    def copies() -> int:
        (row,) = md.version_summaries("listed", nodes)
        return row["copies"][0]

    held = len(md.placement(digest))
    assert copies() == held
    md.remove_placement(digest, "node-a")
    assert copies() == held - 1
    md.add_placement(digest, "node-a")
    assert copies() == held
    assert repairs.placed(md, digest, "node-c")  # a repair's new copy counts at once
    assert copies() == held + 1
    assert trim_marks.mark(md, digest, "node-c", 2, nodes) == 1  # a trim takes it away
    assert copies() == held
    assert md.record_copy(digest, "node-c")  # the crosscheck finds it again
    assert copies() == held + 1
    # A replica settling onto a new node (a late or replayed transfer).
    md.settle(p.vkey, 0, 0, "node-d", digest)
    assert copies() == held + 2
    # The version removed: its blob's deletion from the nodes empties the placement.
    md.begin_remove(p.vkey)
    md.blob_deleted(p.vkey, digest, sorted(md.placement(digest)))
    assert md.r.hget(K.PLACEMENTS_LISTED, digest) is None


def test_status_reads_only_the_versions_it_reports(md, tmp_path):
    healthy = committed_version(md, tmp_path, "h", 50)
    for s, nodes in enumerate(healthy.targets):
        for node in nodes:
            md.add_placement(healthy.manifest.shards[s].blob_sha256, node)
    thin = committed_version(md, tmp_path, "t", 51)  # no copies recorded: under R
    waiting = prepared(tmp_path, "w", 52)
    pending(md, waiting)
    among = list(FREE)
    listed = md.version_summaries(None, among, notable=set())
    assert {r["vkey"] for r in listed} == {thin.vkey, waiting.vkey}
    assert all("digests" not in r for r in listed)
    # A version using a blob a repair names is reported too, with its blobs.
    blob = healthy.manifest.shards[1].blob_sha256
    (row,) = [
        r
        for r in md.version_summaries(None, among, digests=True, notable={blob})
        if r["vkey"] == healthy.vkey
    ]
    assert row["digests"] == [s.blob_sha256 for s in healthy.manifest.shards]
    assert len(md.version_summaries(None, among)) == 3


def test_the_repair_sweep_reads_every_manifest_in_a_few_round_trips(md, tmp_path):
    """wanted_blobs runs every 30 s over every committed version: its manifests come in
    batches, not one request each."""
    vkeys = []
    for i in range(1500):  # over one batch of LISTING_BATCH_VERSIONS
        m = synthetic_manifest("many", i)
        vkey = storage_key(m.name, m.version_id)
        md.create_pending(m, vkey, {}, [("node-a", "node-b") for _ in m.shards])
        md.commit(vkey, m.name)
        vkeys.append(vkey)
    counted = CountedMetadata(md.url)
    counted.r.ping()  # the connection's own handshake is not counted below
    counted.sent = 0
    got = counted.version_blobs([*vkeys, "0" * 32])  # one never recorded: left out
    assert list(got) == vkeys
    m = md.manifest(vkeys[7])
    assert got[vkeys[7]] == VersionBlobs(
        m.name, m.replicas, tuple((s.blob_sha256, s.blob_size) for s in m.shards)
    )
    assert counted.sent == 2  # 1,501 manifests asked: two batches
    counted.sent = 0
    blobs = wanted_blobs(counted)
    assert len(blobs) == 2 * len(vkeys)
    assert counted.sent <= 10


def test_a_transfer_reads_its_shards_span_alone_while_the_version_is_pending(md, tmp_path):
    p = prepared(tmp_path, "spans", 60)
    pending(md, p)
    md.keep_spans(p.vkey, p.spans())
    md.r.delete(K.MANIFEST.format(vkey=p.vkey))  # not read: the spans are enough
    assert md.span(p.vkey, 1) == p.spans()[1]
    md.r.set(K.MANIFEST.format(vkey=p.vkey), p.manifest.to_json())
    assert 0 < md.r.ttl(K.SPANS.format(vkey=p.vkey)) <= defaults.SPANS_TTL_S
    settle_all(md, p)
    md.commit(p.vkey, "spans")
    # Dropped at the commit; a replay after it rebuilds the same span from the manifest.
    assert not md.r.exists(K.SPANS.format(vkey=p.vkey))
    assert md.span(p.vkey, 1) == p.spans()[1]


def test_spans_go_with_an_abort_and_a_remove(md, tmp_path):
    for how in ("abort", "remove"):
        p = prepared(tmp_path, f"gone-{how}", 61)
        pending(md, p)
        md.keep_spans(p.vkey, p.spans())
        if how == "abort":
            md.abort(p.vkey, "source changed")
        else:
            md.begin_remove(p.vkey)
            md.finish_remove(p.vkey)
        assert not md.r.exists(K.SPANS.format(vkey=p.vkey)), how
