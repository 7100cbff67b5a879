"""Blob placement on a real redis-server: what a gather reads of thousands of chunks."""

from __future__ import annotations

from bench.scale_metadata import CountedMetadata
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
