"""Which replica a gather reads each shard from, and which it falls back to.

Each shard is read from one node, so the choice decides how a gather's bytes split over
the nodes' outbound links: the largest shards go first, each to the live holder that has
been given the fewest bytes so far, then moves along chains of holders even it out
(plan/balance.py), so every node serves about the same share (a silent node's share
spreads over the holders of its copies). The others follow as fallbacks, live ones first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from coordinator.plan.balance import greedy, rebalance


def read_order(
    holders: Sequence[Collection[str]], sizes: Sequence[int], alive: Collection[str]
) -> list[list[str]]:
    """Per shard, its holders in the order to try them: the first one balances the bytes
    read per node, then the other live holders, then silent ones; ties by node id."""
    given: dict[str, int] = {}
    live = [[n for n in h if n in alive] for h in holders]
    first = greedy(live, sizes, given)
    rebalance(live, sizes, first, given)
    return [
        sorted(
            holders[i],
            key=lambda n: (n != first.get(i), n not in alive, given.get(n, 0), n),
        )
        for i in range(len(holders))
    ]
