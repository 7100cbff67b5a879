"""A manifest larger than one JSON body (MAX_JSON_BODY_BYTES, 16 MiB) goes to a real node
and comes back in parts, byte-identical; a part out of order is refused;
many manifests are read over one connection (a rebuild's)."""

from __future__ import annotations

import json

import pytest

from coordinator.dataplane.node_client import NodeClient
from smoltorrent import defaults
from smoltorrent.errors import NodeError, NodeUnavailableError
from tests.nodeproc import start_node
from worker_server import wire


@pytest.fixture
def node(tmp_path):
    node = start_node(tmp_path / "node", cluster_key=b"k" * 32)
    yield node
    node.stop()


def test_a_manifest_over_16_mib_round_trips_in_parts(node):
    tensors = {f"t{i}": {"sha": f"{i:064x}"} for i in range(400_000)}
    data = json.dumps({"tensors": tensors}).encode()
    assert len(data) > 2 * defaults.MAX_JSON_BODY_BYTES  # three parts
    client = node.client()
    client.put_manifest("big-manifest", data)
    assert client.list_manifests() == ["big-manifest"]
    assert client.get_manifest("big-manifest") == data
    assert not list((node.data_dir / "tmp").iterdir())  # the parts were published, not left
    client.put_manifest("small", b"{}")  # one part, as before
    assert client.get_manifest("small") == b"{}"


def test_a_part_out_of_order_is_refused(node):
    with node.client()._connection() as sock:
        header = {"op": "manifest_put", "key": "k", "offset": 5, "total": 10}
        wire.send_frame(sock, header, b"12345")
        with pytest.raises(NodeError, match="from offset 0"):
            wire.recv_response(sock, "node")
    assert node.client().list_manifests() == []


class _Counted(NodeClient):
    """A node client that counts the connections it opens."""

    opened = 0

    def _connect(self, timeout=None):
        type(self).opened += 1
        return super()._connect(timeout)


def test_many_manifests_come_over_one_connection_each_failure_costing_only_itself(node):
    """A rebuild reads every manifest copy of a node with get_manifests: over one
    connection, MANIFEST_GET_WINDOW requests ahead of their answers, each copy byte-identical
    to get_manifest's; a key the node answers with an error frame fails alone and the
    connection goes on; a manifest over one answer is read in parts on its own."""
    small = {f"m{i:03d}": json.dumps({"i": i}).encode() for i in range(3 * 16 + 5)}
    big = json.dumps({"pad": "x" * (defaults.MAX_JSON_BODY_BYTES + 10)}).encode()
    client = node.client()
    for key, data in small.items():
        client.put_manifest(key, data)
    client.put_manifest("big", big)
    keys = sorted(small)
    keys[3:3] = ["big"]
    keys[20:20] = ["missing"]
    counted = _Counted(node.address, cluster_key=client.cluster_key)
    got = list(counted.get_manifests(keys))
    assert _Counted.opened == 2  # the row, and the big one read on its own
    assert sorted(k for k, _ in got) == sorted(keys)
    read = dict(got)
    assert isinstance(read.pop("missing"), NodeError)
    assert read == {**small, "big": big}


def test_manifests_of_a_node_that_is_gone_are_each_an_error(node_factory):
    node = node_factory("gone")
    client = node.client()
    client.put_manifest("a", b"{}")
    node.kill()
    got = list(client.get_manifests(["a", "b"]))
    assert [k for k, _ in got] == ["a", "b"]
    assert all(isinstance(e, NodeUnavailableError) for _, e in got)
