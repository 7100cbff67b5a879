"""One node of each shard's few serves it (a gather's reader, a chain's head): choices that
spread the bytes evenly over the nodes.

Taken one shard at a time, largest first, each to its least-loaded node, the choice can
leave a node idle that only a chain of moves would feed: a holds shards of b's and of c's,
c's of d's; the most loaded node b hands a shard to a, a one to c, c one to d. Placement
spreads each node's blobs over every other node (plan/placement.py), which makes such
chains the rule, not the exception. rebalance() finds them: a breadth-first search from
the most loaded node over moves of shards of one size (so every node on the way keeps its
load), to a node that would still carry less than it. Each such path lowers the sum of
squared loads, so it ends; it stops anyway after REBALANCE_ROUNDS_PER_NODE paths a node,
as a few are all greedy choices ever leave (a gather of 28,000 chunks does not search
for long).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Collection, Sequence

from smoltorrent import defaults


def greedy(
    options: Sequence[Collection[str]], sizes: Sequence[int], load: dict[str, int]
) -> dict[int, str]:
    """Largest shard first, each to its least-loaded option (ties: the smaller id)."""
    chosen: dict[int, str] = {}
    for index in sorted(range(len(options)), key=lambda i: (-sizes[i], i)):
        if options[index]:
            chosen[index] = min(options[index], key=lambda n: (load.get(n, 0), n))
            load[chosen[index]] = load.get(chosen[index], 0) + sizes[index]
    return chosen


def rebalance(
    options: Sequence[Collection[str]],
    sizes: Sequence[int],
    chosen: dict[int, str],
    load: dict[str, int],
) -> None:
    """Move shards (chosen: index -> node) along paths that lower the most loaded node's
    bytes, in place (load: node -> bytes it serves)."""
    nodes = {n for opts in options for n in opts}
    for n in nodes:
        load.setdefault(n, 0)
    for _ in range(defaults.REBALANCE_ROUNDS_PER_NODE * len(nodes)):
        # Who serves what, once a round: a path found ends the round, none changes it.
        served: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for index, node in chosen.items():
            served[node][sizes[index]].append(index)
        if not any(_augment(src, options, served, chosen, load) for src in _by_load(load)):
            return


def _by_load(load: dict[str, int]) -> list[str]:
    return sorted(load, key=lambda n: (-load[n], n))


def _augment(
    src: str,
    options: Sequence[Collection[str]],
    served: dict[str, dict[int, list[int]]],
    chosen: dict[int, str],
    load: dict[str, int],
) -> bool:
    """One path of moves from src to a node that would still carry less; applied.
    `served`: node -> shard size -> the shards of that size it serves."""
    for size in sorted(served[src], reverse=True):
        via: dict[str, tuple[str, int]] = {}  # node reached -> (node before, shard moved)
        queue = deque([src])
        while queue:
            node = queue.popleft()
            for index in served[node].get(size, ()):
                for nxt in sorted(options[index]):
                    if nxt == src or nxt in via:
                        continue
                    via[nxt] = (node, index)
                    if load[nxt] + size < load[src]:
                        _apply(nxt, via, chosen, load, size)
                        return True
                    queue.append(nxt)
    return False


def _apply(
    end: str,
    via: dict[str, tuple[str, int]],
    chosen: dict[int, str],
    load: dict[str, int],
    size: int,
) -> None:
    node = end
    while node in via:
        before, index = via[node]
        chosen[index] = node
        load[node] += size
        load[before] -= size
        node = before
