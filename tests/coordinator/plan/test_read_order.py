"""Gather read order: every node serves about the same share of a gather."""

from __future__ import annotations

import random
from collections import Counter

from coordinator.plan.placement import place
from coordinator.plan.read_order import read_order

MB = 10**6


def served(orders: list[list[str]], sizes: list[int]) -> Counter[str]:
    load: Counter[str] = Counter()
    for order, size in zip(orders, sizes, strict=True):
        load[order[0]] += size
    return load


def test_pairs_holding_the_same_blobs_take_turns_serving_them():
    """4 shards x 2 copies on 4 nodes pair up as (a, b), (c, d), (c, d), (a, b): rotating
    by shard index read shards 0 and 3 from a and 1 and 2 from d, leaving b and c idle."""
    holders = [["a", "b"], ["c", "d"], ["c", "d"], ["a", "b"]]
    sizes = [30 * MB, 25 * MB, 25 * MB, 20 * MB]
    orders = read_order(holders, sizes, {"a", "b", "c", "d"})
    assert sorted(o[0] for o in orders) == ["a", "b", "c", "d"]
    assert [sorted(o) for o in orders] == [sorted(h) for h in holders]  # fallbacks kept


def test_equal_nodes_serve_within_one_shard_of_each_other():
    rng = random.Random(5)
    for _ in range(300):
        free = {f"n{i}": 100 * 10**9 for i in range(rng.randint(2, 8))}
        replicas = rng.randint(2, min(3, len(free)))
        sizes = [64 * MB] * rng.randint(1, 24)
        orders = read_order(place(sizes, free, replicas), sizes, set(free))
        load = served(orders, sizes)
        assert max(load[n] for n in free) - min(load[n] for n in free) <= 64 * MB


def test_a_silent_node_is_tried_last_and_its_holders_serve_its_share():
    free = {f"n{i}": 100 * 10**9 for i in range(4)}
    sizes = [64 * MB] * 8
    placement = place(sizes, free, 2)
    orders = read_order(placement, sizes, {"n1", "n2", "n3"})
    assert all(o[-1] == "n0" for o in orders if "n0" in o)
    load = served(orders, sizes)
    assert load["n0"] == 0 and sum(load.values()) == 8 * 64 * MB
    # Its blobs' other copies are on every other node (plan/placement.py): the live
    # nodes split its share and theirs evenly.
    live = [load[n] for n in ("n1", "n2", "n3")]
    assert max(live) - min(live) <= 64 * MB


def test_a_shard_with_no_known_holder_has_nothing_to_try():
    assert read_order([[], ["a"]], [1, 1], {"a"}) == [[], ["a"]]


def test_a_node_only_a_chain_of_moves_can_feed_serves_its_share():
    """Greedy, in turn: c takes the shard it holds with d, then a and a the two it holds
    with c (a before c on the tie). d serves nothing, a two, and no single move helps (c
    would serve two). a hands one to c and c its other to d: one each. Placement spreads
    each node's blobs over every other node (plan/placement.py), where such chains are
    the rule."""
    holders = [["c", "d"], ["a", "c"], ["a", "c"]]
    sizes = [MB] * len(holders)
    load = served(read_order(holders, sizes, {"a", "c", "d"}), sizes)
    assert {n: load[n] for n in "acd"} == {"a": MB, "c": MB, "d": MB}
