"""What every task needs: the metadata store and node clients, made once per process."""

from __future__ import annotations

from functools import cache

from coordinator import config
from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.state.metadata import Metadata, NodeRecord
from smoltorrent.errors import NotFoundError
from tasks.app import REDIS_URL


@cache
def metadata() -> Metadata:
    return Metadata(REDIS_URL)


def client(address: NodeAddress) -> NodeClient:
    return NodeClient(address, cluster_key=config.cluster_key())


def node_client(node_id: str, nodes: dict[str, NodeRecord]) -> NodeClient:
    """A client for a node of the registry `nodes` (read once per task by the caller);
    NotFoundError if it was removed."""
    if node_id not in nodes:
        raise NotFoundError(f"node {node_id} is not registered; see `smoltorrent nodes ls`.")
    return client(nodes[node_id].address)
