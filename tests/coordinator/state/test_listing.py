"""The listing `ls` and `status` read, on a real redis-server."""

from __future__ import annotations

from coordinator.local.synthetic import synthetic_manifest
from coordinator.plan.version_ids import storage_key
from coordinator.state import redis_keys as K
from coordinator.state import repairs, scripts, trim_marks
from smoltorrent import defaults
from tests.coordinator.state.stores import FREE, committed_version, pending, prepared, settle_all


def test_listed_copies_follow_every_placement_change(md, tmp_path):
    """The listing keeps a copy of each placement; every writer of a placement drops it in
    the same step, so `ls` never shows a stale copy count."""
    p = prepared(tmp_path, "listed", 40)
    pending(md, p)
    settle_all(md, p)
    md.versions.commit(p.vkey, "listed")
    digest = p.manifest.entries[0].blob_sha256
    nodes = ["node-a", "node-b", "node-c", "node-d"]

    def copies() -> int:
        (row,) = md.listing.version_summaries("listed", nodes)
        return row["copies"][0]

    held = len(md.blobs.placement(digest))
    assert copies() == held
    md.blobs.remove_placement(digest, "node-a")
    assert copies() == held - 1
    md.blobs.add_placement(digest, "node-a")
    assert copies() == held
    assert repairs.placed(md, digest, "node-c")  # a repair's new copy counts at once
    assert copies() == held + 1
    assert trim_marks.mark(md, digest, "node-c", 2, nodes) == 1  # a trim takes it away
    assert copies() == held
    assert md.blobs.record_copy(digest, "node-c")  # the crosscheck finds it again
    assert copies() == held + 1
    # A replica settling onto a new node (a late or replayed transfer).
    md.transfers.settle(p.vkey, 0, 0, "node-d", digest)
    assert copies() == held + 2
    # The version removed: its blob's deletion from the nodes empties the placement.
    md.removals.begin_remove(p.vkey)
    md.blobs.blob_deleted(p.vkey, digest, sorted(md.blobs.placement(digest)))
    assert md.r.hget(K.PLACEMENTS_LISTED, digest) is None


def test_status_reads_only_the_versions_it_reports(md, tmp_path):
    healthy = committed_version(md, tmp_path, "h", 50)
    for s, nodes in enumerate(healthy.targets):
        for node in nodes:
            md.blobs.add_placement(healthy.manifest.entries[s].blob_sha256, node)
    thin = committed_version(md, tmp_path, "t", 51)  # no copies recorded: under R
    waiting = prepared(tmp_path, "w", 52)
    pending(md, waiting)
    among = list(FREE)
    listed = md.listing.version_summaries(None, among, notable=set())
    assert {r["vkey"] for r in listed} == {thin.vkey, waiting.vkey}
    assert all("digests" not in r for r in listed)
    # A version using a blob a repair names is reported too, with its blobs.
    blob = healthy.manifest.entries[1].blob_sha256
    (row,) = [
        r
        for r in md.listing.version_summaries(None, among, digests=True, notable={blob})
        if r["vkey"] == healthy.vkey
    ]
    assert row["digests"] == [s.blob_sha256 for s in healthy.manifest.entries]
    assert len(md.listing.version_summaries(None, among)) == 3


def test_a_listing_run_again_after_redis_lost_its_scripts_still_answers(md, tmp_path, monkeypatch):
    """A slice run again (it asked for a pending version's keys) still answers if Redis
    lost its script in between (a restart, SCRIPT FLUSH): it is loaded again."""
    p = prepared(tmp_path, "flushed", 80)
    pending(md, p)
    call, runs = scripts.Script.__call__, []

    def flush_before_the_second(self, keys, args=(), client=None):
        if self.name == "listing/slice":
            runs.append(len(keys))
            if len(runs) == 2:
                md.r.script_flush()
        return call(self, keys, args, client)

    monkeypatch.setattr(scripts.Script, "__call__", flush_before_the_second)
    (row,) = md.listing.version_summaries("flushed", ["node-a"])
    assert row["state"] == "pending" and row["transfers_settled"] == 0
    assert len(runs) == 2 and runs[1] > runs[0]  # run again, with the version's keys


def test_a_listing_after_one_that_ran_twice_runs_once(md, tmp_path):
    """A pending version's keys, which a listing passes in a second run, are named for the
    next listing, which passes them in its first: `ls` (or a scrape) while stores are in
    flight runs its script once, not twice."""
    p = prepared(tmp_path, "hinted", 90)
    pending(md, p)

    def script_runs() -> int:
        md.r.config_resetstat()
        (row,) = md.listing.version_summaries("hinted", ["node-a"])
        assert row["state"] == "pending" and row["transfers_settled"] == 0
        stats = md.r.info("commandstats")["cmdstat_evalsha"]
        return stats["calls"] - stats["failed_calls"]  # not the first, before it is loaded

    assert script_runs() == 2  # the first meets the pending version, then runs with it
    assert script_runs() == 1
    settle_all(md, p)  # still right when what the hint names has changed since
    md.versions.commit(p.vkey, "hinted")
    (row,) = md.listing.version_summaries("hinted", ["node-a"])
    assert row["state"] == "committed"


def test_a_listing_in_slices_lists_each_version_once_while_versions_change(md, monkeypatch):
    """Each slice runs alone, from a cursor on the last version read, not a rank (one MULTI
    over every slice held Redis 0.7-1.4 s at 10,000 versions): versions removed before the
    cursor, stored again (moved past it) and added between slices shift nothing. Every
    version listed throughout is listed once, in its latest place, and each name has one
    current version, as CURRENT says after the last slice."""
    monkeypatch.setattr(defaults, "LISTING_SLICE_VERSIONS", 4)

    def store(name: str, index: int) -> str:
        m = synthetic_manifest(name, index)
        vkey = storage_key(name, m.version_id)
        md.versions.create_pending(m, vkey, {}, [])
        md.versions.commit(vkey, name)
        return vkey

    made = [store(f"n{i % 3}", i) for i in range(24)]
    call, slices, gone = scripts.Script.__call__, [], []

    def change_between_slices(self, keys, args=(), client=None):
        if self.name == "listing/slice":
            slices.append(args[:2])
            if len(slices) == 5:  # two slices read (each twice: its blobs' placements)
                for vkey in made[:2]:  # before the cursor: a rank cursor would skip two
                    md.removals.begin_remove(vkey)
                    md.removals.finish_remove(vkey)
                    gone.append(vkey)
                store("n2", 2)  # made[2] stored again: the latest, past the cursor now
                made.append(store("n0", 99))  # a new version, current of n0
        return call(self, keys, args, client)

    monkeypatch.setattr(scripts.Script, "__call__", change_between_slices)
    rows = md.listing.version_summaries(None, ["node-a"])
    assert len(slices) > 3
    # The two removed were read before they went: listed, as a slice saw them.
    assert sorted(r["vkey"] for r in rows) == sorted(made)
    n2 = [r["vkey"] for r in rows if r["name"] == "n2"]
    assert n2[-1] == made[2]  # in its latest place
    for name in ("n0", "n1", "n2"):
        current = [r["vkey"] for r in rows if r["name"] == name and r["current"]]
        assert current == [md.versions.current(name)]
    assert md.versions.current("n0") == made[-1]


def test_listed_states_read_with_cursors_keep_the_request_order(md, monkeypatch):
    """listed_states and version_states walk their zset and hash with ZSCAN and HSCAN (one
    HGETALL of 10,000 states held Redis 7-9 ms): the vkeys still come in request order, a
    version stored again in its new place, each with its state."""
    monkeypatch.setattr(defaults, "LISTING_SCAN_COUNT", 10)
    made = []
    for i in range(300):  # past a listpack: the scans take several calls
        m = synthetic_manifest(f"s{i % 7}", i)
        made.append(storage_key(m.name, m.version_id))
        md.versions.create_pending(m, made[-1], {}, [])
        if i % 5:
            md.versions.commit(made[-1], m.name)
    again = synthetic_manifest("s3", 3)
    md.versions.create_pending(again, made[3], {}, [])  # the latest request now
    vkeys, states = md.listing.listed_states()
    assert vkeys == md.r.zrange(K.ALL_VERSIONS, 0, -1) == [*made[:3], *made[4:], made[3]]
    assert states == md.r.hgetall(K.VERSION_STATES) == md.listing.version_states()
    assert {v for v, s in states.items() if s == "pending"} == set(made[::5])
