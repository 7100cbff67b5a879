"""The cluster as every command sees it: its metadata (a client checked to answer), node
addresses given on the command line, and the words for a node's state."""

from __future__ import annotations

from coordinator.dataplane.node_client import NodeAddress
from coordinator.state.metadata import Metadata
from smoltorrent.errors import SmoltorrentError, UsageError


def metadata() -> Metadata:
    """The metadata store, checked to answer. Made here rather than through the task
    modules: a command that only reads Redis (ls, status, show, ...) does not import
    Celery, a tenth of a second of its start."""
    from coordinator.state.embedded_redis import ensure_redis_url

    md = Metadata(ensure_redis_url())
    md.ping()
    return md


def node_addresses(texts: list[str], default_port: int | None = None) -> list[NodeAddress]:
    """Every address given on the command line, all parsed before any is used: a malformed
    one is a usage error, and nothing is done."""
    try:
        return [NodeAddress.parse(text, default_port) for text in texts]
    except SmoltorrentError as exc:
        raise UsageError(str(exc)) from exc


def at_label(name: str, version: str | None) -> tuple[str, str | None]:
    """`NAME@LABEL` or `NAME@VERSION` as (NAME, the version id it names); any other name as
    it is (a name holding "@" that is stored is that name)."""
    base, named = metadata().versions.split_at(name)
    if named is None:
        return name, version
    if version is not None:
        raise UsageError(f"give {name} or --version, not both: {name!r} names a version")
    return base, named


# down: missed its latest probe, not yet dead; dead: silent past SMOLTORRENT_DEAD_AFTER_S
NODE_STATE = {"up": "up", "down": "down", "dead": "DEAD"}
