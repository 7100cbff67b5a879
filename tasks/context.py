"""What every task needs: the metadata store and node clients, made once per process, and
request ids. Imports no Celery, so a reader's own gather (tasks/gathering.py) starts
without it."""

from __future__ import annotations

import uuid
from functools import cache

import redis

from coordinator import config
from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.plan.manifest import Manifest
from coordinator.state.embedded_redis import ensure_redis_url
from coordinator.state.metadata import Metadata
from coordinator.state.nodes import NodeRecord
from smoltorrent.errors import NotFoundError
from tasks.malloc_trim import release_freed_memory

# Redis restarting or briefly unreachable: the task retries with backoff, like a node
# error, instead of dead-lettering into the Redis it cannot reach.
REDIS_TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

# This worker's start: imported in the worker's main process before the pool forks, so
# every child shares it. A request marked running under another boot id was left by a
# worker that is gone.
BOOT_ID = uuid.uuid4().hex


@cache
def metadata() -> Metadata:
    """The metadata store at the URL the Celery app uses too (ensure_redis_url: the
    setting, else the embedded Redis, started if need be)."""
    return Metadata(ensure_redis_url())


def new_request_id() -> str:
    return uuid.uuid4().hex


def bwlimit_arg(bwlimit: int | None) -> dict:
    """A request's bandwidth limit among its arguments, only when it names one."""
    return {} if bwlimit is None else {"bwlimit": bwlimit}


def client(address: NodeAddress, timeout: float | None = None) -> NodeClient:
    return NodeClient(
        address,
        cluster_key=config.cluster_key(),
        timeout=config.socket_timeout() if timeout is None else timeout,
    )


def node_client(node_id: str, nodes: dict[str, NodeRecord]) -> NodeClient:
    """A client for a node of the registry `nodes` (read once per task by the caller);
    NotFoundError if it was removed."""
    if node_id not in nodes:
        raise NotFoundError(f"node {node_id} is not registered; see `smoltorrent nodes ls`.")
    return client(nodes[node_id].address)


def read_manifest(md: Metadata, vkey: str) -> Manifest:
    """Version `vkey`'s manifest, and what its read and parse freed given back to the
    system at once: their transients (2 MB of text a piece at a time, the header's base64)
    left ~3.5 MB of free pages in the heap at 16 GB, resident under the engine's buffers,
    which its threads take from other arenas (bench/RESULTS.md, memflat5)."""
    manifest = md.versions.manifest(vkey)
    release_freed_memory()
    return manifest
