"""The boot sequence, at every worker start, in the original system's order (after
freeing the sweep locks this host's last boot died holding, beat/sweeps.py, and the
repair sessions it died running, which are planned again at once):

1. file_sync: the planned nodes of this host's pending versions say which of the
   blobs still unsettled they already hold (a transfer may have stored its blob
   and died before settling it);
2. checksum_sync of what was in flight: those nodes re-hash exactly those blobs;
   a good copy settles its transfer as the transfer itself would have (the last
   one queues the commit), a bad one is quarantined by its node and stays
   unsettled;
3. resume transfers: the reconcile pass for this host sends only what is still
   unsettled, so nothing already safe on a node is sent again;
4. crosscheck: queued as the sweep (it runs under its lock), so placement and
   orphans converge too.

It runs in a thread of the worker's main process, so the worker serves its
queues meanwhile; every step is idempotent, so a periodic pass racing it only
repeats work.
"""

from __future__ import annotations

import threading

from celery.signals import worker_ready
from celery.utils.log import get_task_logger

from beat import reconcile, sweeps
from beat.repair import send_repairs
from coordinator import config
from coordinator.dataplane.chunk_source import clear_spool
from coordinator.state import repairs
from coordinator.state.metadata import Metadata
from coordinator.state.nodes import NodeRecord
from coordinator.state.versions import PENDING
from smoltorrent import defaults
from smoltorrent.errors import CopyBeingTrimmedError, SmoltorrentError
from tasks.app import app
from tasks.context import BOOT_ID, metadata, node_client
from tasks.enqueue import settle

log = get_task_logger(__name__)

# (vkey, shard, replica, digest) of one planned transfer
InFlight = tuple[str, int, int, str]


def file_sync(md: Metadata, host: str, registered: dict[str, NodeRecord]):
    """Node id -> the unsettled transfers of `host`'s pending versions whose blob that
    node (their target) already holds."""
    wanted: dict[str, list[InFlight]] = {}
    for vkey, v in md.listing.versions_in(PENDING):
        if v.get("host") != host:
            continue
        shards = md.versions.manifest(vkey).entries
        settled = md.transfers.settled(vkey)
        for shard, nodes in enumerate(md.transfers.plan(vkey)):
            for replica, node_id in enumerate(nodes):
                if f"{shard}:{replica}" not in settled and node_id in registered:
                    item = (vkey, shard, replica, shards[shard].blob_sha256)
                    wanted.setdefault(node_id, []).append(item)
    found: dict[str, list[InFlight]] = {}
    for node_id, items in wanted.items():
        try:
            held = node_client(node_id, registered).has(sorted({i[3] for i in items}))
        except SmoltorrentError as exc:  # down: its transfers are simply sent again
            log.info("boot: node %s not asked: %s", node_id[:12], exc)
            continue
        found[node_id] = [i for i in items if i[3] in held]
    return found


def checksum_sync(found: dict[str, list[InFlight]], registered: dict[str, NodeRecord]) -> int:
    """Re-hash the in-flight blobs on their nodes; settle each good copy. How many."""
    settled = 0
    for node_id, items in found.items():
        if not items:
            continue
        try:
            bad = set(node_client(node_id, registered).verify(sorted({i[3] for i in items})))
        except SmoltorrentError as exc:
            log.info("boot: node %s did not re-hash: %s", node_id[:12], exc)
            continue
        for vkey, shard, replica, digest in items:
            if digest not in bad:
                try:
                    settle(vkey, shard, replica, node_id, digest)
                except CopyBeingTrimmedError:
                    continue  # a trim is deleting it: the resumed transfer sends it again
                settled += 1
    return settled


def run(host: str) -> dict[str, int]:
    md = metadata()
    freed = md.sweeps.free_locks_of_dead_boots(sweeps.REGISTERED, host, BOOT_ID)
    if freed:
        log.warning("boot of %s: freed the locks its last boot died holding: %s", host, freed)
    copies = repairs.free_dead_sessions(md, host, BOOT_ID)
    if copies:
        # Their blobs are still below R: plan them now, not at the next repair sweep.
        log.warning("boot of %s: freed %d repair copies its last boot died sending", host, copies)
        send_repairs(md)
    registered = md.nodes.nodes()
    # Encoded chunks of versions that committed, aborted or are gone, left by a crash.
    pending = {vkey for vkey, _ in md.listing.versions_in(PENDING)}
    clear_spool(config.spool_root(), pending, defaults.SPOOL_ORPHAN_AGE_S)
    found = file_sync(md, host, registered)
    settled = checksum_sync(found, registered)
    counts = reconcile.run_pass(started_host=host)
    app.send_task("smoltorrent.sweep.crosscheck", queue=config.CONTROL_QUEUE)
    result = {"in_flight_found": sum(map(len, found.values())), "settled": settled, **counts}
    log.info("boot of %s: %s", host, result)
    return result


def _run_logged(host: str) -> None:
    try:
        run(host)
    except Exception:  # the periodic sweeps cover whatever the boot could not do
        log.exception("boot sequence of %s failed; the periodic sweeps take over", host)


@worker_ready.connect
def boot_on_start(sender=None, **_) -> None:
    """A worker killed mid-task left unacked messages Redis only redelivers after the
    visibility timeout (hours): bring this host's work back now."""
    threading.Thread(
        target=_run_logged, args=(config.host_id(),), name="smoltorrent-boot", daemon=True
    ).start()
