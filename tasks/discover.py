"""The worker's continuous mDNS browse (SMOLTORRENT_DISCOVER=1): every node that
advertises itself and proves the cluster key is registered by its id, and one that comes
back at a new address is moved there with its shards (coordinator/discovery.py). With no
cluster key, nodes seen are logged once each and never registered.

It runs in the worker's main process, started once the pool is up, so no prefork child
inherits a half-started browser.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery.signals import worker_ready, worker_shutdown
from celery.utils.log import get_logger

from coordinator import config
from tasks.context import metadata

if TYPE_CHECKING:
    from coordinator.discovery import Browser, Found

log = get_logger(__name__)
_browser: list[Browser] = []


_told: set[tuple[str, str]] = set()  # (node id, address) already logged as not registered


def _register(found: Found) -> None:
    from coordinator.discovery import register

    key = config.cluster_key()
    if key is None:
        # Listed, never registered: without a key nothing proves an advert (anyone on the
        # link could add a node, or move a registered one's id to their own address).
        if (found.node_id, str(found.address)) not in _told:
            _told.add((found.node_id, str(found.address)))
            log.warning(
                "discovery: saw node %s at %s; not registering it: no cluster key, so it"
                " cannot prove it is ours. Make one with `smoltorrent init` (every node and"
                " this worker need it), or register nodes by address: smoltorrent nodes add",
                found.node_id[:12],
                found.address,
            )
        return
    outcome, address = register(metadata(), found, key)
    if outcome != "known":
        where = "at" if outcome == "added" else "to"
        log.warning("discovery: node %s %s %s %s", found.node_id[:12], outcome, where, address)


@worker_ready.connect
def start_browsing(sender=None, **_) -> None:
    if config.discover_enabled() and not _browser:
        # Imported here, after the pool forked: zeroconf (3 MB) is then in no pool child,
        # and in no worker at all unless discovery is on.
        from coordinator.discovery import Browser

        _browser.append(Browser(_register).start())
        log.warning("discovery: browsing for _smoltorrent._tcp.local. nodes")


@worker_shutdown.connect
def stop_browsing(sender=None, **_) -> None:
    while _browser:
        _browser.pop().stop()
