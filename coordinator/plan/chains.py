"""Chain order: which node of a shard's replicas heads its chain and which is the tail."""

from __future__ import annotations


def chain_order(targets: list[list[str]], sizes: list[int]) -> list[list[str]]:
    """Order each shard's nodes into a chain so that every node's outbound link carries
    about the same bytes: each node receives each blob it holds once whatever the order,
    and sends it on unless it is the tail, so the node that has sent least heads the chain
    and the one that has sent most is the tail. Largest shards first, ties by node id."""
    sent: dict[str, int] = {}
    out: list[list[str]] = [list(t) for t in targets]
    for index in sorted(range(len(targets)), key=lambda i: (-sizes[i], i)):
        nodes = sorted(targets[index], key=lambda n: (sent.get(n, 0), n))
        for node in nodes[:-1]:
            sent[node] = sent.get(node, 0) + sizes[index]
        out[index] = nodes
    return out
