"""Reading one shard from the first of its replicas that serves it intact.

Both gathers (whole checkpoint, selected tensors) try a shard's replicas in order: a
copy that proves corrupt is reported (the integrity sweep repairs it) and the next
replica is tried, as it is after a node that does not answer or answers wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.dataplane.node_client import NodeClient
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


def first_intact(
    shard: int,
    digest: str,
    replicas: Sequence[NodeClient],
    read: Callable[[NodeClient], object],
    on_bad_copy: Callable[[BadCopy], None],
) -> tuple[str | None, list[str]]:
    """Run read(client) on each replica in turn until one raises nothing; return that
    replica's address (None when none did) and one line per replica that failed."""
    tried: list[str] = []
    for client in replicas:
        try:
            read(client)
        except DigestMismatchError as exc:
            tried.append(f"{client.address}: {exc}")
            on_bad_copy(BadCopy(shard, digest, str(client.address), str(exc)))
        except (NodeUnavailableError, NodeError, ProtocolError) as exc:
            tried.append(f"{client.address}: {exc}")
        else:
            return str(client.address), tried
    return None, tried
