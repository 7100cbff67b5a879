"""Reading one shard from the first of its replicas that serves it intact.

Both gathers (whole checkpoint, selected tensors) try a shard's replicas in order: a
copy that proves corrupt is reported (the integrity sweep repairs it) and the next
replica is tried, as it is after a node that does not answer or answers wrongly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.dataplane.node_client import KeptConnections, NodeClient
from smoltorrent.errors import (
    DigestMismatchError,
    NodeError,
    NodeUnavailableError,
    ProtocolError,
)


@dataclass(frozen=True)
class BadCopy:
    """A replica that answered with bytes that are not its blob: wrong size or wrong hash."""

    shard: int
    digest: str
    address: str
    reason: str


class Unanswered:
    """The nodes that did not answer one gather (a connect or a read timed out, the
    connection dropped). Its later shards try them after their other replicas: with a
    read per chunk, each chunk a lost node was first for would otherwise wait out the
    same timeout before falling back. Shared by the gather's threads."""

    def __init__(self) -> None:
        self._addresses: set[str] = set()
        self._lock = threading.Lock()

    def add(self, address: str) -> None:
        with self._lock:
            self._addresses.add(address)

    def last(self, replicas: Sequence[NodeClient]) -> list[NodeClient]:
        """`replicas` in their order, those that did not answer moved to the end."""
        with self._lock:
            silent = set(self._addresses)
        return sorted(replicas, key=lambda client: str(client.address) in silent)


def first_intact(
    shard: int,
    digest: str,
    replicas: Sequence[NodeClient],
    read: Callable[[NodeClient], object],
    on_bad_copy: Callable[[BadCopy], None],
    unanswered: Unanswered | None = None,
) -> tuple[str | None, list[str]]:
    """Run read(client) on each replica in turn until one raises nothing; return that
    replica's address (None when none did) and one line per replica that failed. With
    `unanswered`, replicas that did not answer this gather before are tried last, and one
    that does not answer now is added."""
    tried: list[str] = []
    for client in unanswered.last(replicas) if unanswered else replicas:
        try:
            read(client)
        except DigestMismatchError as exc:
            tried.append(f"{client.address}: {exc}")
            on_bad_copy(BadCopy(shard, digest, str(client.address), str(exc)))
        except (NodeUnavailableError, NodeError, ProtocolError) as exc:
            tried.append(f"{client.address}: {exc}")
            if unanswered is not None and isinstance(exc, NodeUnavailableError):
                unanswered.add(str(client.address))
        else:
            return str(client.address), tried
    return None, tried


def keeping(
    sources: Sequence[Sequence[NodeClient]], kept: KeptConnections
) -> list[Sequence[NodeClient]]:
    """Each shard's replicas, each client over `kept`'s connections (a gather's threads
    keep them from one shard or chunk to the next). A client, or a list of them, the
    caller shares between shards is shared here too: one per node and one per read order
    for thousands of chunks (tasks/gathering.py), where a copy each grew a gather's memory
    with the chunk count. The gathers only read them."""
    clients: dict[int, NodeClient] = {}
    lists: dict[int, list[NodeClient]] = {}
    for replicas in sources:
        if id(replicas) not in lists:
            for c in replicas:
                if id(c) not in clients:
                    clients[id(c)] = c.keeping(kept)
            lists[id(replicas)] = [clients[id(c)] for c in replicas]
    return [lists[id(replicas)] for replicas in sources]
