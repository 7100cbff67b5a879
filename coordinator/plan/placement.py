"""Choose the nodes that keep each shard: R distinct ones, spread, weighted by free space.

Shards are placed largest first, each on the R nodes that can hold it and hold
the fewest blobs for their share of the free space, then the fewest bytes for
it: equal nodes take turns, so each ends within one blob of the mean however
unequal the shards (a gather then reads about as much from each), and a node
with ten times the free space takes ten times the blobs. Free space counts as
equal within PLACEMENT_EQUAL_FREE_SHARE of the roomiest node, so the few MB of
noise in free bytes read a moment apart decide nothing.

Among nodes equal so far, a shard's nodes are the ones that have held fewest shards
together: every pair of nodes takes its turn (on 4 nodes at R=2, all 6 pairs, not the
same 2). A node lost for good then has the other copies of its blobs spread over every
survivor, so all of them send its repair at once and it heals at the survivors' links
together, not at one partner's (invariant 13). Ties after that go to the smaller node
id, so the same input always gives the same placement.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence

from coordinator.plan.safetensors_header import format_bytes
from smoltorrent import defaults
from smoltorrent.errors import InsufficientSpaceError, NotEnoughNodesError, SmoltorrentError

_NODES_LISTED = 5  # nodes named in an error message; more would bury the sentence


def place(
    shard_sizes: Sequence[int], free_bytes: Mapping[str, int], replicas: int
) -> list[tuple[str, ...]]:
    """For each shard (sizes in bytes), the ids of the `replicas` nodes that will hold it."""
    if replicas < 1:
        raise SmoltorrentError(f"--replicas must be at least 1, got {replicas}.")
    if len(free_bytes) < replicas:
        raise NotEnoughNodesError(_not_enough_nodes(replicas, sorted(free_bytes)))
    room_left = dict(free_bytes)
    placed = dict.fromkeys(free_bytes, 0)
    blobs = dict.fromkeys(free_bytes, 0)
    partners: Counter[frozenset[str]] = Counter()  # shards each two nodes hold together
    share = _free_share(free_bytes)
    placement: list[tuple[str, ...]] = [()] * len(shard_sizes)
    # Shards on the same nodes share one tuple: a few node sets for thousands of chunks.
    shared: dict[tuple[str, ...], tuple[str, ...]] = {}
    for index in sorted(range(len(shard_sizes)), key=lambda i: (-shard_sizes[i], i)):
        size = shard_sizes[index]
        fitting = [node for node in room_left if room_left[node] >= size]
        if len(fitting) < replicas:
            raise InsufficientSpaceError(_no_room(index, size, replicas, room_left))
        chosen: list[str] = []
        for _ in range(replicas):
            chosen.append(
                min(
                    (node for node in fitting if node not in chosen),
                    key=lambda node: (
                        blobs[node] / share[node],
                        sum(partners[frozenset((node, c))] for c in chosen),
                        placed[node] / share[node],
                        node,
                    ),
                )
            )
        for a, b in itertools.combinations(chosen, 2):
            partners[frozenset((a, b))] += 1
        for node in chosen:
            room_left[node] -= size
            placed[node] += size
            blobs[node] += 1
        nodes = tuple(chosen)
        placement[index] = shared.setdefault(nodes, nodes)
    return placement


def _free_share(free_bytes: Mapping[str, int]) -> dict[str, float]:
    """Each node's free space as a share of the roomiest node's, in steps of
    PLACEMENT_EQUAL_FREE_SHARE (and never zero: a node that fits a shard may hold it)."""
    step = defaults.PLACEMENT_EQUAL_FREE_SHARE
    roomiest = max(max(free_bytes.values()), 1)
    return {node: max(round(free / roomiest / step), 1) * step for node, free in free_bytes.items()}


def _not_enough_nodes(replicas: int, nodes: list[str]) -> str:
    needed = (
        "1 replica needs 1 live node"
        if replicas == 1
        else f"{replicas} replicas need {replicas} live nodes"
    )
    if not nodes:
        return f"{needed}, but none is reachable. Start nodes with `smoltorrent serve`."
    reachable = "only 1 is reachable" if len(nodes) == 1 else f"only {len(nodes)} are reachable"
    return (
        f"{needed}, but {reachable} ({_listing(nodes)}). Start more nodes with "
        f"`smoltorrent serve`, or store with --replicas {len(nodes)}."
    )


def _no_room(index: int, size: int, replicas: int, room_left: Mapping[str, int]) -> str:
    roomiest = sorted(room_left, key=lambda node: (-room_left[node], node))
    fitting = sum(room_left[node] >= size for node in roomiest)
    free = [f"{node} {format_bytes(max(room_left[node], 0))}" for node in roomiest]
    return (
        f"shard {index} needs {format_bytes(size)} on each of {replicas} nodes, but only "
        f"{fitting} {'node has' if fitting == 1 else 'nodes have'} that much free once the "
        f"larger shards are placed (free: {_listing(free)}). Free space on the nodes, add "
        "nodes with `smoltorrent serve`, or store with fewer --replicas."
    )


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_NODES_LISTED])
    return (
        shown if len(items) <= _NODES_LISTED else f"{shown} and {len(items) - _NODES_LISTED} more"
    )
