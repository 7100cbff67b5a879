"""Which replica a gather reads each shard from, and which it falls back to.

Each shard is read from one node, so the choice decides how a gather's bytes split over
the nodes' outbound links: the largest shards go first, each to the live holder that has
been given the fewest bytes so far, so every node serves about the same share (two
nodes that hold the same blobs take turns, and a silent node's share spreads over the
holders of its copies). The others follow as fallbacks, live ones first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def read_order(
    holders: Sequence[Collection[str]], sizes: Sequence[int], alive: Collection[str]
) -> list[list[str]]:
    """Per shard, its holders in the order to try them: the first one balances the bytes
    read per node, then the other live holders, then silent ones; ties by node id."""
    given: dict[str, int] = {}
    first: dict[int, str] = {}
    largest_first = sorted(range(len(holders)), key=lambda i: (-sizes[i], i))
    for index in largest_first:
        live = [n for n in holders[index] if n in alive]
        if live:
            first[index] = min(live, key=lambda n: (given.get(n, 0), n))
            given[first[index]] = given.get(first[index], 0) + sizes[index]
    # Taken one at a time, an early shard can leave a node idle that a later one needed:
    # move a shard to a holder that would still serve less than its reader does now,
    # until none is left (each move lowers the sum of squared loads, so this ends).
    moved = True
    while moved:
        moved = False
        for index in largest_first:
            if index not in first:
                continue
            reader, size = first[index], sizes[index]
            live = [n for n in holders[index] if n in alive]
            best = min(live, key=lambda n: (given.get(n, 0), n))
            if given.get(best, 0) + size < given[reader]:
                given[reader] -= size
                given[best] = given.get(best, 0) + size
                first[index] = best
                moved = True
    return [
        sorted(
            holders[i],
            key=lambda n: (n != first.get(i), n not in alive, given.get(n, 0), n),
        )
        for i in range(len(holders))
    ]
