"""Chain order: every node heads and forwards about the same bytes."""

from __future__ import annotations

import random
from collections import Counter

from coordinator.plan.chains import chain_order
from coordinator.plan.placement import place

MB = 10**6


def outbound(chains: list[list[str]], sizes: list[int]) -> Counter[str]:
    sent: Counter[str] = Counter()
    for nodes, size in zip(chains, sizes, strict=True):
        for node in nodes[:-1]:  # the tail passes nothing on
            sent[node] += size
    return sent


def headed(chains: list[list[str]], sizes: list[int]) -> Counter[str]:
    """Bytes each node receives from the coordinator: those of the chains it heads."""
    load: Counter[str] = Counter()
    for nodes, size in zip(chains, sizes, strict=True):
        load[nodes[0]] += size
    return load


def spread(load: Counter[str], nodes) -> int:
    return max(load[n] for n in nodes) - min(load[n] for n in nodes)


def test_pairs_placed_together_take_turns_heading_their_chains() -> None:
    targets = [["a", "b"], ["c", "d"], ["a", "b"], ["c", "d"]]
    sizes = [100, 100, 100, 100]
    chains = chain_order(targets, sizes)
    assert [sorted(c) for c in chains] == [sorted(t) for t in targets]  # same nodes, reordered
    assert outbound(chains, sizes) == {"a": 100, "b": 100, "c": 100, "d": 100}
    assert headed(chains, sizes) == {"a": 100, "b": 100, "c": 100, "d": 100}


def test_three_copies_spread_heads_and_middles() -> None:
    nodes = ["a", "b", "c", "d"]
    targets = [[nodes[(i + k) % 4] for k in range(3)] for i in range(8)]
    sizes = [10] * 8
    chains = chain_order(targets, sizes)
    assert all(len(set(c)) == 3 for c in chains)
    assert spread(outbound(chains, sizes), nodes) <= 10
    assert sum(outbound(chains, sizes).values()) == 8 * 2 * 10
    assert headed(chains, sizes) == dict.fromkeys(nodes, 20)


def test_equal_nodes_head_and_forward_within_one_blob_of_each_other() -> None:
    """The placement's chains on equal nodes (free bytes a few MB apart): each node heads
    within one blob of every other, so the coordinator's sends spread over all inbound
    links; forwards are within one for R=2 and within two for longer chains (a node may
    hold one blob more and be a tail once less)."""
    rng = random.Random(7)
    for _ in range(500):
        count = rng.randint(2, 8)
        free = {f"n{i}": 100 * 10**9 + rng.randint(0, 20) * MB for i in range(count)}
        replicas = rng.randint(2, min(4, count))
        sizes = [64 * MB] * rng.randint(1, 24)
        targets = [list(t) for t in place(sizes, free, replicas)]
        chains = chain_order(targets, sizes)
        assert [sorted(c) for c in chains] == [sorted(t) for t in targets]
        heads = {n: v // (64 * MB) for n, v in headed(chains, sizes).items()}
        forwards = {n: v // (64 * MB) for n, v in outbound(chains, sizes).items()}
        assert spread(Counter(heads), free) <= 1, (replicas, chains)
        assert spread(Counter(forwards), free) <= (1 if replicas == 2 else 2), (replicas, chains)


def test_unequal_shards_spread_heads_by_bytes() -> None:
    rng = random.Random(8)
    for _ in range(300):
        free = {f"n{i}": 100 * 10**9 for i in range(rng.randint(2, 8))}
        sizes = [rng.randint(1, 100) * MB for _ in range(rng.randint(1, 24))]
        chains = chain_order([list(t) for t in place(sizes, free, 2)], sizes)
        assert spread(headed(chains, sizes), free) <= 2 * max(sizes)
        assert spread(outbound(chains, sizes), free) <= 2 * max(sizes)
