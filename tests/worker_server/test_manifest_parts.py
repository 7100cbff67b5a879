"""A manifest larger than one JSON body (MAX_JSON_BODY_BYTES, 16 MiB) goes to a real node
and comes back in parts, byte-identical; a part out of order is refused."""

from __future__ import annotations

import json

import pytest

from smoltorrent import defaults
from smoltorrent.errors import NodeError
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
