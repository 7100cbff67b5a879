"""Removes and retention on a real redis-server."""

from __future__ import annotations

from coordinator.dataplane.store_engine import prepare_store
from coordinator.state import redis_keys as K
from coordinator.state import scripts
from coordinator.state.versions import COMMITTED
from tests.coordinator.state.stores import FREE, committed_version, pending, prepared, settle_all


def test_bookkeeping_is_bounded_once_settled(md, tmp_path):
    p = prepared(tmp_path, "bounded", 11)
    pending(md, p)
    for i in range(1200):
        md.transfers.record_attempt(
            p.vkey, {"shard": 0, "replica": 0, "node": "node-a", "attempt": i}
        )
    assert (
        len(md.transfers.attempts(p.vkey)) == 1000
        and md.transfers.attempts(p.vkey)[-1]["attempt"] == 1199
    )
    settle_all(md, p)
    md.versions.commit(p.vkey, "bounded")
    assert md.r.ttl(f"smoltorrent:version:{p.vkey}:attempts") > 0
    md.dead_letters.add_dead_letter(f"transfer-{p.vkey}-0-1", {"task": "smoltorrent.transfer"})
    md.dead_letters.add_dead_letter("transfer-other-0-1", {"task": "smoltorrent.transfer"})
    assert md.removals.begin_remove(p.vkey) == COMMITTED
    assert md.blobs.blobs_to_delete(p.vkey) == {s.blob_sha256 for s in p.manifest.entries}
    for s in p.manifest.entries:
        md.blobs.blob_deleted(p.vkey, s.blob_sha256, ["node-a", "node-b"])
        assert not md.r.exists(f"smoltorrent:blob:{s.blob_sha256}:nodes")  # placement gone
    assert md.dead_letters.drop_dead_letters_of(p.vkey) == 1
    assert md.removals.finish_remove(p.vkey)
    assert [r["task_id"] for r in md.dead_letters.dead_letters()] == ["transfer-other-0-1"]
    leftovers = [k for k in md.r.scan_iter(f"smoltorrent:*{p.vkey}*")]
    assert leftovers == [f"smoltorrent:version:{p.vkey}"]  # the expiring tombstone only


def test_a_blob_shared_by_two_versions_is_deleted_only_with_the_last(md, tmp_path):
    p = prepared(tmp_path, "one", 12)
    twin = prepare_store(p.path, "two", FREE, replicas=2, shards=2)  # same bytes, other name
    pending(md, p)
    pending(md, twin)
    digests = {s.blob_sha256 for s in p.manifest.entries}
    assert md.blobs.blob_refs(next(iter(digests))) == {p.vkey, twin.vkey}
    md.removals.begin_remove(p.vkey)
    assert md.blobs.blobs_to_delete(p.vkey) == set()
    md.removals.begin_remove(twin.vkey)
    assert md.blobs.blobs_to_delete(twin.vkey) == digests
    assert all(md.blobs.blob_deleting(d) for d in digests)  # a store now waits, then re-sends


def test_retire_spares_the_current_the_pending_the_read_and_the_newest_k(md, tmp_path):
    pa, pb, pc = (committed_version(md, tmp_path, "r", seed) for seed in (20, 21, 22))
    a, b, c = pa.vkey, pb.vkey, pc.vkey
    d = prepared(tmp_path, "r", 23)
    pending(md, d)  # being stored: the newest request of all
    assert md.removals.retire(d.vkey, 1) == "pending"
    assert md.removals.retire(c, 1) == "current"
    assert md.removals.retire(b, 2) == "kept"  # c and b are the newest two committed
    # A gather reading b: retention waits for it, however old b is.
    assert md.removals.start_reading(b, "host:1:task", 60) == COMMITTED
    assert md.removals.readers(b) == ["host:1:task"]
    assert md.removals.retire(b, 1) == "reading"
    md.removals.stop_reading(b, "host:1:task")
    assert md.removals.retire(b, 1) == "retired"
    assert md.versions.state(b) == "removing"
    assert md.removals.start_reading(b, "host:2:task", 60) == "removing"  # no gather starts now
    assert md.removals.readers(b) == []
    # A store of a's bytes again (a rollback) makes it current: it stays, c goes.
    assert pending(md, pa) is False
    assert md.versions.current("r") == a
    assert md.removals.retire(a, 1) == "current"
    assert md.removals.retire(c, 1) == "retired"
    # A mark that is not refreshed lapses (a gather killed mid-way blocks nothing for long).
    e = committed_version(md, tmp_path, "r", 24).vkey
    assert md.removals.start_reading(a, "host:3:task", 0.001) == COMMITTED
    while md.removals.readers(a):
        pass
    assert md.removals.retire(a, 1) == "retired"
    assert md.versions.current("r") == e


def test_retire_takes_an_aborted_version_only_under_a_newer_committed_one(md, tmp_path):
    old = prepared(tmp_path, "s", 30)
    pending(md, old)
    md.versions.abort(old.vkey, "source changed")
    assert md.removals.retire(old.vkey, 3) == "kept"  # its reason stays visible until a store lands
    committed_version(md, tmp_path, "s", 31)
    assert md.removals.retire(old.vkey, 3) == "retired"
    assert md.blobs.blobs_to_delete(old.vkey) == {s.blob_sha256 for s in old.manifest.entries}


def test_a_remove_not_passed_a_version_it_must_read_changes_nothing_and_is_run_again(md, tmp_path):
    """The caller reads which versions a remove may look at (here: the one to make current
    next); a version it did not pass, say one committed in between, makes the script change
    nothing and say so, and begin_remove reads the versions again."""
    a = committed_version(md, tmp_path, "n", 70).vkey
    b = committed_version(md, tmp_path, "n", 71).vkey
    keys = [
        K.VERSION.format(vkey=b),
        K.VERSIONS.format(name="n"),
        K.CURRENT,
        K.CURRENT_SEQ,
        K.REMOVE_BLOBS.format(vkey=b),
        K.VERSION_STATES,
    ]
    begin = scripts.load(md.r, "removals/begin")
    assert begin(keys=keys, args=["n", b, 0, 60, 0]) == "stale"
    assert md.versions.state(b) == COMMITTED and md.versions.current("n") == b
    assert md.removals.begin_remove(b) == COMMITTED
    assert md.versions.current("n") == a


def test_retire_by_prefix_takes_whole_old_names_but_no_pinned_pending_or_newer_one(md, tmp_path):
    """Retention per prefix (issue 22): the entries past the K newest under a prefix go,
    their current versions too, in the same guarded step as the last K per name."""
    from coordinator.state import retention

    f1 = committed_version(md, tmp_path, "run/f", 40)  # two versions, the older entry
    f2 = committed_version(md, tmp_path, "run/f", 41)
    b = committed_version(md, tmp_path, "run/b", 42)
    late = prepared(tmp_path, "run/f", 43)  # stored again later on
    c = committed_version(md, tmp_path, "run/c", 44)
    d = prepared(tmp_path, "run/d", 45)
    pending(md, d)  # in flight: the newest entry
    names, before = retention.plan(md, "run/", 2)
    assert names == ["run/f", "run/b"] and before is not None
    assert md.removals.retire(b.vkey, 2, before) == "retired"  # run/b's current, whole
    assert md.versions.current("run/b") is None
    md.versions.pin(f1.vkey)
    assert md.removals.retire(f1.vkey, 2, before) == "pinned"
    assert md.removals.retire(f2.vkey, 2, before) == "retired"  # current: f1 takes over
    assert md.versions.current("run/f") == f1.vkey
    # A new request for run/f (after the plan was made) keeps it: checked in the script.
    md.versions.unpin(f1.vkey)
    pending(md, late)
    assert md.removals.retire(f1.vkey, 2, before) == "kept"
    assert md.removals.retire(late.vkey, 2, before) == "pending"
    assert md.removals.retire(c.vkey, 2, before) == "kept"  # among the two newest
    assert md.removals.retire(d.vkey, 2, before) == "pending"
