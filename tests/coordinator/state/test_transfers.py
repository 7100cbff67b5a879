"""Transfers of a pending version on a real redis-server: the commit barrier and the spans."""

from __future__ import annotations

from coordinator.state import redis_keys as K
from smoltorrent import defaults
from tests.coordinator.state.stores import pending, prepared, settle_all


def test_the_barrier_fires_once_and_only_when_every_transfer_settled(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 1)
    assert pending(md, p) is True
    assert pending(md, p, "t2") is False  # the same bytes again: one version
    digests = [s.blob_sha256 for s in p.manifest.entries]
    fired = [
        md.transfers.settle(p.vkey, 0, 0, "node-a", digests[0]),
        md.transfers.settle(p.vkey, 0, 1, None, digests[0]),  # a dead replica still settles
        md.transfers.settle(p.vkey, 1, 0, "node-b", digests[1]),
        md.transfers.settle(p.vkey, 1, 1, "node-a", digests[1]),
    ]
    assert fired == [False, False, False, True]
    # Until the commit is queued, a redelivery of the last transfer fires again (the
    # commit is idempotent); once it is queued, never.
    assert md.transfers.settle(p.vkey, 1, 1, "node-a", digests[1]) is True
    md.transfers.mark_commit_enqueued(p.vkey)
    assert md.transfers.settle(p.vkey, 1, 1, "node-a", digests[1]) is False
    assert md.blobs.placement(digests[0]) == {"node-a"}
    assert md.transfers.ready_shards(p.vkey) == {0, 1}


def test_a_shard_with_no_copy_holds_the_barrier_until_its_replay_succeeds(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 2)
    pending(md, p)
    d = [s.blob_sha256 for s in p.manifest.entries]
    assert not md.transfers.settle(p.vkey, 0, 0, "node-a", d[0])
    assert not md.transfers.settle(p.vkey, 0, 1, "node-b", d[0])
    assert not md.transfers.settle(p.vkey, 1, 0, None, d[1])
    assert not md.transfers.settle(p.vkey, 1, 1, None, d[1])  # all settled, shard 1 has no copy
    assert md.transfers.settle(p.vkey, 1, 0, "node-a", d[1]) is True  # the replayed transfer


def test_a_transfer_reads_its_shards_span_alone_while_the_version_is_pending(md, tmp_path):
    p = prepared(tmp_path, "spans", 60)
    pending(md, p)
    md.transfers.keep_spans(p.vkey, p.spans())
    md.r.delete(K.MANIFEST.format(vkey=p.vkey))  # not read: the spans are enough
    assert md.transfers.span(p.vkey, 1) == p.spans()[1]
    md.r.set(K.MANIFEST.format(vkey=p.vkey), p.manifest.to_json())
    assert 0 < md.r.ttl(K.SPANS.format(vkey=p.vkey)) <= defaults.SPANS_TTL_S
    settle_all(md, p)
    md.versions.commit(p.vkey, "spans")
    # Dropped at the commit; a replay after it rebuilds the same span from the manifest.
    assert not md.r.exists(K.SPANS.format(vkey=p.vkey))
    assert md.transfers.span(p.vkey, 1) == p.spans()[1]


def test_spans_go_with_an_abort_and_a_remove(md, tmp_path):
    for how in ("abort", "remove"):
        p = prepared(tmp_path, f"gone-{how}", 61)
        pending(md, p)
        md.transfers.keep_spans(p.vkey, p.spans())
        if how == "abort":
            md.versions.abort(p.vkey, "source changed")
        else:
            md.removals.begin_remove(p.vkey)
            md.removals.finish_remove(p.vkey)
        assert not md.r.exists(K.SPANS.format(vkey=p.vkey)), how
