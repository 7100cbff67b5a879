"""Chain order: which node of a shard's replicas heads its chain and which is the tail.

Every node receives each blob it holds once, whatever the order; what the order decides
is who receives it from the coordinator (the head) and who passes it on (every node but
the tail). Both are spread: the coordinator's sends reach every node's inbound link
alike, and every node's outbound link forwards about the same bytes.
"""

from __future__ import annotations

from coordinator.plan.balance import greedy, rebalance


def chain_order(targets: list[list[str]], sizes: list[int]) -> list[list[str]]:
    """Order each shard's nodes into a chain: who heads it, who passes it on, and its
    tail. Each choice is one node per shard, made largest shard first to the node that
    carries fewest bytes so far and then evened out along chains of nodes
    (plan/balance.py): first the heads, by bytes headed; then, R-2 times, one more of
    each chain's nodes to forward it, by bytes forwarded (every head forwards). The node
    left is the tail. Ties go to the smaller id."""
    headed: dict[str, int] = {}
    heads = greedy(targets, sizes, headed)
    rebalance(targets, sizes, heads, headed)
    chains = {i: [head] for i, head in heads.items()}
    forwarded = dict(headed)
    for _ in range(max((len(t) for t in targets), default=0) - 2):
        options = [
            [n for n in t if n not in chains.get(i, ())] if len(t) - len(chains.get(i, ())) > 1
            else []
            for i, t in enumerate(targets)
        ]  # fmt: skip
        more = greedy(options, sizes, forwarded)
        rebalance(options, sizes, more, forwarded)
        for i, node in more.items():
            chains[i].append(node)
    out: list[list[str]] = [list(t) for t in targets]
    for i, chain in chains.items():
        out[i] = chain + [n for n in targets[i] if n not in chain]
    return out
