"""Where a node's fsyncs are (invariant 3), read from the system calls it makes
(tests/syscall_order.py): strace is attached to real nodes while they take blobs (a put, a
chain of two, a replication), manifests (whole and in parts) and deletes. Every blob and
manifest must be fsynced before its rename, and its directory after the rename or unlink
and before the node's reply.
"""

from __future__ import annotations

from pathlib import Path

from tests.syscall_order import DurableOrder, attached, says_over_tcp, under


def test_every_name_a_node_makes_or_removes_is_durable_before_it_is_acknowledged(
    node_factory, make_blob, tmp_path: Path
) -> None:
    nodes = [node_factory("a"), node_factory("b")]
    traces = [tmp_path / "a.trace", tmp_path / "b.trace"]
    big = make_blob(3 * 1024 * 1024 + 17)  # arrives in many reads, written as it comes
    chained = make_blob(2 * 1024 * 1024)
    copied = make_blob(64 * 1024)
    with attached(nodes[0].pid, traces[0]), attached(nodes[1].pid, traces[1]):
        a = nodes[0].client()
        assert make_blob(1000).put(a)
        assert big.put(a)
        a.chain_put(
            chained.digest, chained.prefix, chained.fd, chained.offset, chained.length,
            [nodes[1].address],
        )  # fmt: skip
        assert copied.put(a) and a.replicate(copied.digest, nodes[1].address)
        a.put_manifest("v1", b'{"name": "run/v1"}')
        a.put_manifest("v2", b"x" * (17 * 1024 * 1024))  # over one body: in parts
        assert a.delete(big.digest) and a.delete_manifest("v1")
    orders = [
        DurableOrder(under(n.data_dir / "blobs", n.data_dir / "manifests"), says_over_tcp).read(
            t.read_text()
        )
        for n, t in zip(nodes, traces, strict=True)
    ]
    assert [o.faults for o in orders] == [[], []]
    # Everything above was seen, and acknowledged: the checks were not vacuous. Node a
    # made 4 blobs and 2 manifests and removed 2; node b took the chain's and the copy's.
    assert [o.made for o in orders] == [8, 2]
    assert [o.acknowledged for o in orders] == [8, 2]
