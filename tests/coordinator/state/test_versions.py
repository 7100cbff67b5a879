"""Versions on a real redis-server: states, the current version and the request order."""

from __future__ import annotations

import json

import pytest

from bench.scale_metadata import CountedMetadata
from coordinator.local.synthetic import synthetic_manifest
from coordinator.plan.manifest import VersionBlobs
from coordinator.plan.version_ids import storage_key
from coordinator.state import redis_keys as K
from coordinator.state.repair_plan import wanted_blobs
from coordinator.state.versions import COMMITTED
from smoltorrent import defaults
from tests.coordinator.state.stores import FREE, pending, prepared, settle_all


def test_an_older_version_committing_late_does_not_become_current(md, tmp_path):
    old, new = prepared(tmp_path, "latest", 3), prepared(tmp_path, "latest", 4)
    pending(md, old)  # accepted first: the lower sequence number
    pending(md, new)
    assert md.versions.commit(new.vkey, "latest") is True
    assert md.versions.commit(old.vkey, "latest") is False
    assert md.versions.current("latest") == new.vkey
    assert md.versions.version(old.vkey)["state"] == COMMITTED  # still gatherable by version
    assert md.removals.begin_remove(new.vkey) == COMMITTED
    assert md.versions.current("latest") == old.vkey  # the newest remaining committed one


def test_a_store_of_older_bytes_makes_their_version_current_again(md, tmp_path):
    """A, B, A under one name: training rolled back and re-saved; the name serves A."""
    a, b = prepared(tmp_path, "run/latest", 5), prepared(tmp_path, "run/latest", 6)
    pending(md, a)
    md.versions.commit(a.vkey, "run/latest")
    pending(md, b)
    md.versions.commit(b.vkey, "run/latest")
    assert md.versions.current("run/latest") == b.vkey
    assert pending(md, a) is False  # no bytes move: the version exists, committed
    assert md.versions.current("run/latest") == a.vkey
    assert md.versions.versions("run/latest") == [b.vkey, a.vkey]  # ordered by latest request


def test_a_rollback_while_both_are_pending_ends_on_the_latest_request(md, tmp_path):
    a, b = prepared(tmp_path, "x", 7), prepared(tmp_path, "x", 8)
    pending(md, a)
    pending(md, b)
    pending(md, a)  # A asked for again before either committed
    md.versions.commit(a.vkey, "x")
    assert md.versions.commit(b.vkey, "x") is False
    assert md.versions.current("x") == a.vkey


def test_the_current_content_stored_again_while_a_newer_store_is_pending_stays_current(
    md, tmp_path
):
    """A current; B asked for (still uploading); A asked for again: it moves no bytes and
    is already current, but it is the latest request, so B committing later does not
    take the name. make_current returned early for a version already current without
    raising the name's request order, and B won."""
    a, b = prepared(tmp_path, "y", 11), prepared(tmp_path, "y", 12)
    pending(md, a)
    md.versions.commit(a.vkey, "y")
    pending(md, b)
    assert pending(md, a) is False and md.versions.current("y") == a.vkey
    assert md.versions.commit(b.vkey, "y") is False
    assert md.versions.current("y") == a.vkey
    assert md.versions.version(b.vkey)["state"] == COMMITTED  # gatherable by its version


def test_a_late_transfer_never_changes_a_committed_versions_state(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 9)
    pending(md, p)
    settle_all(md, p)
    assert md.versions.commit(p.vkey, "ckpt") is True
    digest = p.manifest.entries[0].blob_sha256
    assert md.versions.abort(p.vkey, "a late transfer saw the source change") is False
    assert md.transfers.settle(p.vkey, 0, 1, "node-c", digest) is False  # a dead-letter replay
    assert md.versions.version(p.vkey)["state"] == COMMITTED
    assert "node-c" in md.blobs.placement(digest)  # ... which still adds its replica


def test_a_removed_version_is_never_committed_nor_made_current(md, tmp_path):
    p = prepared(tmp_path, "gone", 10)
    pending(md, p)
    settle_all(md, p)
    assert md.removals.begin_remove(p.vkey) == "pending"
    digest = p.manifest.entries[0].blob_sha256
    before = md.blobs.placement(digest)
    assert md.transfers.settle(p.vkey, 0, 0, "node-z", digest) is False
    assert md.blobs.placement(digest) == before  # a removing version records nothing
    assert md.versions.commit(p.vkey, "gone") is False
    assert (
        md.versions.current("gone") is None and md.versions.version(p.vkey)["state"] == "removing"
    )
    assert md.removals.finish_remove(p.vkey) is True
    assert md.versions.commit(p.vkey, "gone") is False
    assert md.versions.current("gone") is None and md.versions.version(p.vkey)["state"] == "removed"
    assert md.versions.versions("gone") == [] and md.versions.names() == []
    assert md.r.ttl(f"smoltorrent:version:{p.vkey}") > 0  # the tombstone expires
    assert md.versions.restore_committed(p.manifest, p.vkey) is False  # rebuild leaves it gone
    assert pending(md, p) is True  # storing the same bytes again starts afresh


def test_the_repair_sweep_reads_every_manifest_in_a_few_round_trips(md, tmp_path):
    """wanted_blobs runs every 30 s over every committed version: its manifests come in
    batches, not one request each."""
    vkeys = []
    for i in range(1500):  # over one batch of LISTING_BATCH_VERSIONS
        m = synthetic_manifest("many", i)
        vkey = storage_key(m.name, m.version_id)
        md.versions.create_pending(m, vkey, {}, [("node-a", "node-b") for _ in m.entries])
        md.versions.commit(vkey, m.name)
        vkeys.append(vkey)
    counted = CountedMetadata(md.url)
    counted.r.ping()  # the connection's own handshake is not counted below
    counted.sent = 0
    got = counted.versions.version_blobs([*vkeys, "0" * 32])  # one never recorded: left out
    assert list(got) == vkeys
    m = md.versions.manifest(vkeys[7])
    assert got[vkeys[7]] == VersionBlobs(
        m.name, m.replicas, tuple((s.blob_sha256, s.blob_size) for s in m.entries)
    )
    assert counted.sent == 2  # 1,501 manifests asked: two batches
    counted.sent = 0
    blobs = wanted_blobs(counted)
    assert len(blobs) == 2 * len(vkeys)
    assert counted.sent <= 12  # the listing, pins and currents, the manifests in batches


def test_the_repair_sweep_parses_a_committed_manifest_once_while_its_commit_stands(md):
    """Issue 22: the repair sweep read and parsed every committed manifest every 30 s. Its
    next pass reads none of them again (only one short stamp each); a version committed
    since is read, one committed again is read afresh, one removed leaves."""
    vkeys = []
    for i in range(50):
        m = synthetic_manifest("kept", i)
        vkey = storage_key(m.name, m.version_id)
        md.versions.create_pending(m, vkey, {}, [("node-a", "node-b") for _ in m.entries])
        md.versions.commit(vkey, m.name)
        vkeys.append(vkey)
    counted = CountedMetadata(md.url)
    first = wanted_blobs(counted)
    gets = counted.r.info("commandstats")["cmdstat_get"]["calls"]
    assert wanted_blobs(counted) == first
    assert counted.r.info("commandstats")["cmdstat_get"]["calls"] == gets  # no manifest read

    m = synthetic_manifest("kept", 50)
    new = storage_key(m.name, m.version_id)
    md.versions.create_pending(m, new, {}, [("node-a", "node-b") for _ in m.entries])
    md.versions.commit(new, m.name)
    md.r.hset(K.VERSION.format(vkey=vkeys[0]), "committed_at", "1")  # committed again
    md.r.hset(K.VERSION.format(vkey=vkeys[1]), "committed_at", "2")
    md.r.zrem(K.ALL_VERSIONS, vkeys[2])  # no longer listed: removed
    before = counted.r.info("commandstats")["cmdstat_get"]["calls"]
    again = wanted_blobs(counted)
    read = counted.r.info("commandstats")["cmdstat_get"]["calls"] - before
    assert read == 3  # the manifests of the new version and of the two committed again
    assert set(counted.versions._parsed) == set(vkeys[:2] + vkeys[3:] + [new])
    assert len(again) == len(first) + len(md.versions.manifest(new).entries) - len(
        md.versions.manifest(vkeys[2]).entries
    )


def test_a_store_records_the_tensor_count_it_planned_with(md, tmp_path):
    """The store task passes the tensor count it read at plan time (a chunked manifest's
    own count parses its whole header again: the largest part of a store's peak memory);
    the listing row is the one the manifest alone gives."""
    from coordinator.dataplane.chunk_engine import prepare_chunked_store
    from coordinator.local.synthetic import write_checkpoint
    from coordinator.state.versions import listing_row

    path = tmp_path / "chunked.safetensors"
    write_checkpoint(path, 300_000, hidden=32)
    p = prepare_chunked_store(path, "chunked", FREE, tmp_path / "spool")
    assert p.tensor_count == p.manifest.tensor_count() > 0
    targets = list(p.targets)
    assert md.versions.create_pending(p.manifest, p.vkey, {}, targets, tensors=p.tensor_count)
    row = md.r.hget(K.VERSION_ROWS, p.vkey)
    assert row == listing_row(p.manifest, sum(len(t) for t in targets))
    shards = prepared(tmp_path, "sharded", 1)
    assert shards.tensor_count == shards.manifest.tensor_count() > 0


def test_a_pending_versions_plan_names_each_entrys_nodes(md):
    """The plan is passed as one JSON text per distinct node order (entries share them);
    each entry's field holds its own nodes, in order."""
    m = synthetic_manifest("planned", 2, shards=5)
    vkey = storage_key(m.name, m.version_id)
    order = (("node-a", "node-b"), ("node-b", "node-a"), ("node-c",))
    plan = [order[i % 3] for i in range(len(m.entries))]
    assert md.versions.create_pending(m, vkey, {}, plan) == "created"
    assert md.transfers.plan(vkey) == plan
    stored = md.r.hgetall(K.PLAN.format(vkey=vkey))
    assert stored == {str(i): json.dumps(list(t)) for i, t in enumerate(plan)}


@pytest.mark.parametrize("pipeline_bytes", [defaults.REBUILD_PIPELINE_BYTES, 1])
def test_a_rebuilds_versions_are_recorded_a_batch_at_a_time(md, monkeypatch, pipeline_bytes):
    """A rebuild records REBUILD_BATCH_VERSIONS restored versions at once, as
    restore_committed one by one does (each a new request number in their order, committed,
    the last of each name current, its listing row and manifest), a version Redis knows
    left as it is: in a few round trips for the batch, where one by one took five a
    version. A pipeline staging more than REBUILD_PIPELINE_BYTES is sent before the next."""
    monkeypatch.setattr(defaults, "REBUILD_PIPELINE_BYTES", pipeline_bytes)
    count = defaults.REBUILD_BATCH_VERSIONS
    manifests = [synthetic_manifest(f"n{i % 3}", i) for i in range(count)]
    vkeys = [m.storage_key() for m in manifests]
    known = 4  # a store's, pending: known to Redis, so not restored
    md.versions.create_pending(manifests[known], vkeys[known], {}, [("a",)] * 2)
    counted = CountedMetadata(md.url)
    counted.r.ping()  # the connection's own handshake is not counted below
    counted.sent = 0
    done = counted.versions.restore_committed_many(
        [(m, v, m.tensor_count()) for m, v in zip(manifests, vkeys, strict=True)]
    )
    assert done == [i != known for i in range(count)]
    if pipeline_bytes > 1:  # one pipeline for the batch
        assert counted.sent <= 10  # 5 * 31 one by one
    assert md.versions.version(vkeys[known])["state"] == "pending"
    restored = [i for i in range(count) if i != known]
    seqs = [int(md.versions.version(vkeys[i])["seq"]) for i in restored]
    assert seqs == sorted(set(seqs))
    for i in restored:
        version = md.versions.version(vkeys[i])
        assert version["state"] == COMMITTED and version["rebuilt"] == "1"
        assert md.versions.manifest(vkeys[i]) == manifests[i]
        row = json.loads(md.r.hget(K.VERSION_ROWS, vkeys[i]))
        assert row["tensors"] == manifests[i].tensor_count() and row["name"] == f"n{i % 3}"
    for n in range(3):
        last = max(i for i in restored if i % 3 == n)
        assert md.versions.current(f"n{n}") == vkeys[last]
    again = md.versions.restore_committed_many([(manifests[0], vkeys[0], None)])
    assert again == [False]


def test_a_store_over_an_aborted_version_in_another_encoding_leaves_no_reference_behind(
    md, tmp_path
):
    """A store aborted (its references kept until retention removes it), then the same
    content stored again as other blobs (another encoding: auto flips with the nodes,
    SMOLTORRENT_ENCODE, a zstd upgrade). versions/create recreated the version over the
    aborted one and referenced the new blobs, but the old ones kept naming it: the remove
    reads the recorded manifest, the new one, so nothing ever took those away."""
    import dataclasses

    p = prepared(tmp_path, "ab", 9)
    assert pending(md, p)
    old = {s.blob_sha256 for s in p.manifest.entries}
    assert md.versions.abort(p.vkey, "a node went away")
    other = dataclasses.replace(
        p.manifest,
        shards=tuple(
            dataclasses.replace(s, blob_sha256=f"{i:064x}") for i, s in enumerate(p.manifest.shards)
        ),
    )
    assert pending(md, dataclasses.replace(p, manifest=other))
    new = {s.blob_sha256 for s in other.entries}
    for digest in old:
        assert p.vkey not in md.blobs.blob_refs(digest), digest
    for digest in new:
        assert p.vkey in md.blobs.blob_refs(digest), digest
