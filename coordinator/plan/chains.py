"""Chain order: which node of a shard's replicas heads its chain and which is the tail.

Every node receives each blob it holds once, whatever the order; what the order decides
is who receives it from the coordinator (the head) and who passes it on (every node but
the tail). Both are spread: the coordinator's sends reach every node's inbound link
alike, and every node's outbound link forwards about the same bytes.
"""

from __future__ import annotations


def chain_order(targets: list[list[str]], sizes: list[int]) -> list[list[str]]:
    """Order each shard's nodes into a chain, largest shards first: the node that has
    headed fewest bytes heads it, and of the others the one that has forwarded most is
    its tail (so the nodes that forward it are those that have forwarded least). Ties go
    to the node that has forwarded less, then headed less, then to the smaller id."""
    headed: dict[str, int] = {}
    sent: dict[str, int] = {}
    out: list[list[str]] = [list(t) for t in targets]
    for index in sorted(range(len(targets)), key=lambda i: (-sizes[i], i)):
        nodes = sorted(targets[index])
        head = min(nodes, key=lambda n: (headed.get(n, 0), sent.get(n, 0), n))
        rest = [n for n in nodes if n != head]
        chain = [head]
        if rest:
            tail = max(rest, key=lambda n: (sent.get(n, 0), -headed.get(n, 0), n))
            chain += [n for n in rest if n != tail] + [tail]
        headed[head] = headed.get(head, 0) + sizes[index]
        for node in chain[:-1]:
            sent[node] = sent.get(node, 0) + sizes[index]
        out[index] = chain
    return out
