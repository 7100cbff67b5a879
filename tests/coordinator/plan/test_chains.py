"""Chain order: every node's outbound link carries about the same bytes."""

from __future__ import annotations

from coordinator.plan.chains import chain_order


def outbound(chains: list[list[str]], sizes: list[int]) -> dict[str, int]:
    sent: dict[str, int] = {}
    for nodes, size in zip(chains, sizes, strict=True):
        for node in nodes[:-1]:  # the tail passes nothing on
            sent[node] = sent.get(node, 0) + size
    return sent


def test_pairs_placed_together_take_turns_heading_their_chains() -> None:
    # Placement as it is today with equal free space: shards 0 and 2 on A, B; 1 and 3 on C, D.
    targets = [["a", "b"], ["c", "d"], ["a", "b"], ["c", "d"]]
    sizes = [100, 100, 100, 100]
    chains = chain_order(targets, sizes)
    assert [sorted(c) for c in chains] == [sorted(t) for t in targets]  # same nodes, reordered
    assert outbound(chains, sizes) == {"a": 100, "b": 100, "c": 100, "d": 100}


def test_three_copies_spread_heads_and_middles() -> None:
    nodes = ["a", "b", "c", "d"]
    targets = [[nodes[(i + k) % 4] for k in range(3)] for i in range(8)]
    sizes = [10] * 8
    sent = outbound(chain_order(targets, sizes), sizes)
    assert max(sent.values()) - min(sent.values()) <= 10
    assert sum(sent.values()) == 8 * 2 * 10
