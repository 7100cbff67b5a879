"""Placement: R distinct nodes per shard, spread evenly, weighted by free space."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from coordinator.plan.placement import place
from smoltorrent.errors import InsufficientSpaceError, NotEnoughNodesError, SmoltorrentError

GB = 10**9


def held_per_node(placement: list[tuple[str, ...]]) -> Counter[str]:
    return Counter(node for nodes in placement for node in nodes)


def test_four_nodes_four_shards_two_replicas_every_node_holds_two():
    free = {"node-a": 100 * GB, "node-b": 100 * GB, "node-c": 100 * GB, "node-d": 100 * GB}
    placement = place([GB] * 4, free, 2)
    assert all(len(set(nodes)) == 2 for nodes in placement)
    assert held_per_node(placement) == {node: 2 for node in free}


def test_replicas_are_distinct_and_fit_in_free_space():
    rng = random.Random(3)
    for _ in range(200):
        sizes = [rng.randint(0, 3) * GB for _ in range(rng.randint(0, 12))]
        # Every node could hold every shard: a refusal here would be a placement bug.
        floor = max(sum(sizes), 1)
        free = {f"n{i}": floor + rng.randint(0, 50) * GB for i in range(rng.randint(1, 7))}
        replicas = rng.randint(1, len(free))
        placement = place(sizes, free, replicas)
        assert len(placement) == len(sizes)
        used = Counter()
        for size, nodes in zip(sizes, placement, strict=True):
            assert len(nodes) == replicas == len(set(nodes))
            assert set(nodes) <= free.keys()
            for node in nodes:
                used[node] += size
        assert all(used[node] <= free[node] for node in free)


def test_placements_that_cannot_fit_are_refused():
    rng = random.Random(5)
    for _ in range(200):
        free = {f"n{i}": rng.randint(1, 50) * GB for i in range(rng.randint(1, 7))}
        replicas = rng.randint(1, len(free))
        # One shard larger than the R-th roomiest node: no placement can hold it R times.
        too_big = sorted(free.values(), reverse=True)[replicas - 1] + 1
        sizes = [rng.randint(0, 3) * GB for _ in range(rng.randint(0, 6))] + [too_big]
        rng.shuffle(sizes)
        with pytest.raises(InsufficientSpaceError, match="needs"):
            place(sizes, free, replicas)
        # Or more bytes in all than the nodes have together.
        total = sum(free.values())
        sizes = [total // replicas // 4 + 1] * 4 + [1]
        with pytest.raises(InsufficientSpaceError):
            place(sizes, free, replicas)


def test_a_node_with_far_more_free_space_gets_more_shards():
    free = {"pi-1": 10 * GB, "pi-2": 10 * GB, "nas": 100 * GB}
    placement = place([GB] * 12, free, 1)
    held = held_per_node(placement)
    assert held["nas"] > held["pi-1"] + held["pi-2"]


def test_largest_shard_goes_where_the_room_is():
    free = {"small": 5 * GB, "large": 50 * GB, "medium": 20 * GB}
    placement = place([GB, 30 * GB, GB], free, 1)
    assert placement[1] == ("large",)


def test_placement_is_deterministic_and_ties_go_to_the_smaller_node_id():
    free = {"c": GB, "a": GB, "b": GB}
    assert place([10, 10, 10], free, 2) == [("a", "b"), ("c", "a"), ("b", "c")]
    assert place([10, 10, 10], dict(reversed(free.items())), 2) == place([10, 10, 10], free, 2)


def test_more_shards_than_nodes_spread_evenly():
    free = {f"node-{i}": 100 * GB for i in range(3)}
    held = held_per_node(place([GB] * 9, free, 2))
    assert sorted(held.values()) == [6, 6, 6]


def test_nodes_sharing_one_disk_hold_equal_counts_whatever_the_noise_in_free_space():
    """Free bytes read a moment apart differ by a few MB; small shards must still spread
    evenly instead of piling on the nodes that happened to report the most."""
    mb = 10**6
    free = {"node-a": 100 * GB + 7 * mb, "node-b": 100 * GB + 5 * mb}
    free |= {"node-c": 100 * GB + 3 * mb, "node-d": 100 * GB + 1 * mb}
    for shards in (4, 8, 13):
        held = held_per_node(place([mb] * shards, free, 2))
        mean = 2 * shards / len(free)
        assert all(abs(held[node] - mean) <= 1 for node in free), (shards, held)


def test_unequal_shards_on_equal_nodes_still_spread_by_count():
    """Shards cut at tensor boundaries differ in size (an embedding table makes one large):
    placing by bytes alone put 4 shards x 2 copies on 4 equal nodes as 1, 1, 3, 3 blobs."""
    free = {node: 100 * GB for node in ("node-a", "node-b", "node-c", "node-d")}
    for sizes in ([60, 20, 20, 15], [100, 10, 10, 10], [5, 5, 5, 90]):
        held = held_per_node(place([s * 10**6 for s in sizes], free, 2))
        assert held == {node: 2 for node in free}, (sizes, held)


def test_equal_nodes_hold_within_one_blob_of_the_mean_for_any_shard_sizes():
    rng = random.Random(11)
    mb = 10**6
    for _ in range(300):
        nodes = rng.randint(2, 8)
        free = {f"n{i}": 100 * GB + rng.randint(0, 20) * mb for i in range(nodes)}
        replicas = rng.randint(1, min(3, nodes))
        scale = (1, 10, 100, 1000)
        sizes = [rng.choice(scale) * mb * rng.randint(1, 9) for _ in range(rng.randint(1, 24))]
        placement = place(sizes, free, replicas)
        assert all(len(set(nodes)) == replicas for nodes in placement)
        held = held_per_node(placement)
        mean = replicas * len(sizes) / len(free)
        assert all(abs(held[node] - mean) < 1 for node in free), (sizes, replicas, held)


def test_no_shards_need_no_placement():
    assert place([], {"node-a": GB}, 1) == []


def test_too_few_nodes_raises_a_sentence_that_says_what_to_do():
    with pytest.raises(NotEnoughNodesError) as raised:
        place([GB], {"node-a": 10 * GB}, 2)
    assert str(raised.value) == (
        "2 replicas need 2 live nodes, but only 1 is reachable (node-a). "
        "Start more nodes with `smoltorrent serve`, or store with --replicas 1."
    )
    with pytest.raises(NotEnoughNodesError, match="only 2 are reachable \\(a, b\\).*--replicas 2"):
        place([GB], {"b": GB, "a": GB}, 3)
    with pytest.raises(
        NotEnoughNodesError, match="1 replica needs 1 live node, but none is reachable"
    ):
        place([GB], {}, 1)


def test_no_room_raises_insufficient_space():
    free = {"node-a": 10 * GB, "node-b": 2 * GB}
    with pytest.raises(InsufficientSpaceError) as raised:
        place([GB, 5 * GB], free, 2)
    message = str(raised.value)
    assert "shard 1 needs 5.0 GB on each of 2 nodes, but only 1 node has that much free" in message
    assert "node-a 10.0 GB, node-b 2.0 GB" in message


def test_replicas_below_one_is_refused():
    with pytest.raises(SmoltorrentError, match="--replicas must be at least 1"):
        place([GB], {"node-a": GB}, 0)


def test_a_nodes_blobs_have_their_other_copies_on_every_other_node():
    """A node lost for good is repaired from wherever its blobs' other copies are: all on
    one partner (4 nodes pairing up as a-b and c-d every time), one survivor's link carried
    the whole repair while the others idled (issue 37, the Pi emulation)."""
    for nodes, replicas in ((4, 2), (5, 2), (6, 3)):
        free = {f"node-{i}": 100 * GB for i in range(nodes)}
        placement = place([10**6] * 60, free, replicas)
        for node in free:
            partners = Counter(n for held in placement if node in held for n in held)
            del partners[node]
            assert set(partners) == set(free) - {node}, (nodes, node, partners)
            assert max(partners.values()) - min(partners.values()) <= 1, (nodes, partners)
