"""The trim mark and the barrier's refusal, on a real redis-server."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.state import redis_keys as K
from coordinator.state import scripts, trim_marks
from smoltorrent.errors import CopyBeingTrimmedError
from tests.coordinator.state.stores import pending, prepared

UP = ["node-a", "node-b", "node-c"]


def test_a_copy_is_marked_only_while_surplus_and_no_replica_counts_on_it(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 1)  # R=2
    pending(md, p)
    digest = p.manifest.entries[0].blob_sha256
    for n in UP:
        md.blobs.add_placement(digest, n)
    assert trim_marks.mark(md, digest, "node-z", 2, UP) == -1  # not a holder
    assert trim_marks.mark(md, digest, "node-c", 2, UP) == 1
    assert md.blobs.placement(digest) == {"node-a", "node-b"}
    assert trim_marks.marked(md, digest, UP) == {"node-c"}
    # A transfer that put its copy there meanwhile is refused while the mark stands.
    with pytest.raises(CopyBeingTrimmedError):
        md.transfers.settle(p.vkey, 0, 0, "node-c", digest)
    assert md.blobs.placement(digest) == {"node-a", "node-b"}
    assert md.transfers.settled(p.vkey) == set()
    # A replica counted from an old read of the placement is refused once it left it,
    # mark or not; one still listed counts.
    trim_marks.clear(md, digest, "node-c")
    with pytest.raises(CopyBeingTrimmedError):
        md.transfers.settle(p.vkey, 0, 0, "node-c", digest, held=True)
    assert md.transfers.settle(p.vkey, 0, 0, "node-a", digest, held=True) is False
    # A sent copy settles once the delete is done (its mark cleared).
    assert md.transfers.settle(p.vkey, 0, 1, "node-c", digest) is False
    assert md.blobs.placement(digest) == set(UP)


def test_a_version_at_a_higher_r_keeps_every_copy_from_the_trim(md, tmp_path):
    low = prepared(tmp_path, "low", 2)
    pending(md, low)
    digest = low.manifest.entries[0].blob_sha256
    for n in UP:
        md.blobs.add_placement(digest, n)
    assert trim_marks.mark(md, digest, "node-c", 3, UP) == 0  # the sweep's own R
    # A pending version of another name using the same blob at R=3.
    m3 = dataclasses.replace(low.manifest, name="high", replicas=3)
    md.versions.create_pending(m3, m3.storage_key(), {"request_id": "t3"}, list(low.targets))
    assert digest in {s.blob_sha256 for s in m3.entries}
    assert trim_marks.mark(md, digest, "node-c", 2, UP) == 0
    assert md.blobs.placement(digest) == set(UP) and not trim_marks.marked(md, digest, UP)
    # Counted on up nodes only: a copy on a node not up does not make one surplus.
    md.blobs.remove_placement(digest, "node-b")
    assert trim_marks.mark(md, digest, "node-c", 1, ["node-a", "node-c"]) == 0


def test_a_trim_not_passed_a_version_using_the_blob_changes_nothing(md, tmp_path):
    p = prepared(tmp_path, "ckpt", 3)
    pending(md, p)
    digest = p.manifest.entries[0].blob_sha256
    for n in UP:
        md.blobs.add_placement(digest, n)
    keys = [
        K.PLACEMENT.format(digest=digest),
        K.BLOB_REFS.format(digest=digest),
        K.TRIM_MARK.format(digest=digest, node_id="node-c"),
        K.PLACEMENTS_LISTED,
    ]
    mark = scripts.load(md.r, "trim_marks/mark")
    assert mark(keys=keys, args=["node-c", 2, 60, digest, len(UP), *UP]) == -2
    assert md.blobs.placement(digest) == set(UP) and not trim_marks.marked(md, digest, UP)
    assert trim_marks.mark(md, digest, "node-c", 2, UP) == 1  # its caller passes them
