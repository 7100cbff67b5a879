"""Blob placement on a real redis-server: what a gather reads of thousands of chunks."""

from __future__ import annotations

from bench.scale_metadata import CountedMetadata
from coordinator.state import redis_keys as K
from coordinator.state.repair_plan import placements
from smoltorrent import defaults


def test_placement_of_many_blobs_reads_them_in_batches_sharing_each_node_set(md):
    """A gather's thousands of chunks: every placement, in order, in one round trip per
    PLACEMENT_BATCH_DIGESTS (not one pipeline holding them all), blobs on the same nodes
    sharing one set."""
    digests = [f"{i:064x}" for i in range(2 * defaults.PLACEMENT_BATCH_DIGESTS + 3)]
    nodes = [("a", "b"), ("b", "c"), ("c",), ()]
    for i, digest in enumerate(digests):
        for node in nodes[i % len(nodes)]:
            md.blobs.add_placement(digest, node)
    counted = CountedMetadata(md.url)
    counted.r.ping()  # the connection's own handshake is not counted below
    counted.sent = 0
    got = counted.blobs.placement_of(digests)
    assert got == [set(nodes[i % len(nodes)]) for i in range(len(digests))]
    assert counted.sent == 3
    assert len({id(p) for p in got}) == len(nodes)
    assert counted.blobs.placement_of([]) == []


def test_placements_added_in_batches_drop_their_listed_copies(md):
    """A rebuild's placements: PLACEMENT_BATCH_DIGESTS a round trip, each blob's listed
    copy (what `ls` reads) dropped with its change, as add_placement does one at a time."""
    digests = [f"{i:064x}" for i in range(defaults.PLACEMENT_BATCH_DIGESTS + 3)]
    md.blobs.add_placements(digests, "a")
    md.r.hset(K.PLACEMENTS_LISTED, mapping={d: "a" for d in digests})
    counted = CountedMetadata(md.url)
    counted.r.ping()
    counted.sent = 0
    counted.blobs.add_placements(digests, "b")
    assert counted.sent == 2
    assert md.blobs.placement_of(digests) == [{"a", "b"}] * len(digests)
    assert md.r.hlen(K.PLACEMENTS_LISTED) == 0


def test_every_placement_read_in_batches_from_a_scan(md):
    """The crosscheck's read of every placement: the keys from a SCAN, their sets a batch
    of PLACEMENT_BATCH_DIGESTS at a time, every one of them, across batch ends."""
    digests = [f"{i:064x}" for i in range(2 * defaults.PLACEMENT_BATCH_DIGESTS + 5)]
    md.blobs.add_placements(digests[::2], "a")
    md.blobs.add_placements(digests, "b")
    md.blobs.remove_placement(digests[1], "b")  # an empty set is no key: not listed
    want = {d: ({"a", "b"} if i % 2 == 0 else {"b"}) for i, d in enumerate(digests) if i != 1}
    assert md.blobs.placements() == want
    assert md.blobs.referenced(digests) == {d: False for d in digests}


def test_the_repair_sweeps_placements_are_read_in_batches(md):
    """The repair sweep reads the placement of every blob in use (100,000 at scale):
    PLACEMENT_BATCH_DIGESTS a round trip, not one pipeline of them all holding Redis."""
    digests = [f"{i:064x}" for i in range(2 * defaults.PLACEMENT_BATCH_DIGESTS + 3)]
    md.blobs.add_placements(digests[::3], "a")
    md.blobs.add_placements(digests[1::3], "b")
    counted = CountedMetadata(md.url)
    counted.r.ping()
    counted.sent = 0
    got = placements(counted, iter(digests))
    assert counted.sent == 3
    assert got == {d: [{"a"}, {"b"}, set()][i % 3] for i, d in enumerate(digests)}
