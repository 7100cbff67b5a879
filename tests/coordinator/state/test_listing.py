"""The listing `ls` and `status` read, on a real redis-server."""

from __future__ import annotations

from coordinator.state import redis_keys as K
from coordinator.state import repairs, scripts, trim_marks
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
    """A slice run again (it asked for a pending version's keys) skips the check that its
    script is loaded; if Redis lost it in between (a restart, SCRIPT FLUSH), it is loaded
    again."""
    p = prepared(tmp_path, "flushed", 80)
    pending(md, p)
    queue, flushed = scripts.Script.queue_loaded, []

    def flush_first(self, pipe, keys, args):
        md.r.script_flush()
        flushed.append(self.name)
        queue(self, pipe, keys, args)

    monkeypatch.setattr(scripts.Script, "queue_loaded", flush_first)
    (row,) = md.listing.version_summaries("flushed", ["node-a"])
    assert row["state"] == "pending" and row["transfers_settled"] == 0
    assert flushed == ["listing/slice"]


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
        return md.r.info("commandstats")["cmdstat_evalsha"]["calls"]

    assert script_runs() == 2  # the first meets the pending version, then runs with it
    assert script_runs() == 1
    settle_all(md, p)  # still right when what the hint names has changed since
    md.versions.commit(p.vkey, "hinted")
    (row,) = md.listing.version_summaries("hinted", ["node-a"])
    assert row["state"] == "committed"
