"""The scrub sweep (checksum_sync): every node re-hashes its blobs at its bounded rate
(worker_server/scrub.py); this sweep starts a pass on each node where none runs, reads
what each found, takes the bad copies out of the placement so the repair sweep copies
them again, and discards a bad copy once a good one is counted on another node. Copies a
gather found corrupt are re-hashed by their nodes here too (those the gather's own
bad_copy task could not check). Every copy found bad has its repair queued in the same
pass (beat/repair.py send_repairs), not at the next repair sweep."""

from __future__ import annotations

from celery.utils.log import get_task_logger

from beat.repair import send_repairs
from beat.sweeps import sweep
from coordinator import config
from coordinator.dataplane.node_client import NodeClient
from coordinator.state import scrub_reports
from coordinator.state.healing import (
    UNREACHABLE,
    check_bad_copy,
    check_reported_bad,
    settle_quarantined,
)
from coordinator.state.liveness import DEAD, node_health
from smoltorrent import defaults
from tasks.app import app
from tasks.context import REDIS_TRANSIENT, metadata

log = get_task_logger(__name__)


def run_pass(*, start: bool = True) -> dict[str, int]:
    """Ask every up node for its scrub report (and, with `start`, to start a pass if
    none runs); act on the bad copies reported."""
    md = metadata()
    nodes = md.nodes.nodes()
    alive = md.nodes.alive(nodes)
    health = node_health(md, config.dead_after(), set(alive))
    counted = {n for n, h in health.items() if h.state != DEAD}
    key = config.cluster_key()
    counts = {
        "nodes": 0,
        "quarantined": 0,
        "released": 0,
        "discarded": 0,
        "reported_bad": 0,
        "repairs_sent": 0,
    }
    found: set[str] = set()
    for node_id in sorted(set(alive) & set(nodes)):
        try:
            report = NodeClient(nodes[node_id].address, cluster_key=key).scrub(start=start)
        except UNREACHABLE as exc:
            log.info("scrub: node %s did not answer (%s); asked again next pass", node_id, exc)
            continue
        counts["nodes"] += 1
        saved = scrub_reports.record(md, node_id, report)
        counts["quarantined"] += len(saved["quarantined"])
        try:
            did = settle_quarantined(md, nodes, key, node_id, saved["quarantined"], counted)
        except UNREACHABLE:
            continue
        counts["released"] += len(did["released"])
        counts["discarded"] += len(did["discarded"])
        found.update(did["released"])
    reported = check_reported_bad(md, nodes, key)
    counts["reported_bad"] = len(reported)
    found.update(d for d, _ in reported)
    if found:
        counts["repairs_sent"] = len(send_repairs(md, found).repairs)
    if counts["released"] or counts["discarded"] or counts["reported_bad"]:
        log.warning("scrub: %s", counts)
    return counts


@sweep("scrub")
def scrub(start: bool = True) -> dict[str, int]:
    """One round of every node's scrub reports (and, with `start`, passes started)."""
    return run_pass(start=start)


@app.task(
    name="smoltorrent.bad_copy",
    autoretry_for=REDIS_TRANSIENT,
    retry_backoff=defaults.RETRY_BACKOFF_BASE_S,
    retry_jitter=False,
    max_retries=config.transfer_retries(),
)
def bad_copy(digest: str, node_id: str) -> dict:
    """A copy a gather just found corrupt: its node re-hashes it now, and if it is bad its
    repair is queued now. A node that does not answer leaves the report on record for the
    scrub sweep."""
    md = metadata()
    try:
        bad = check_bad_copy(md, md.nodes.nodes(), config.cluster_key(), digest, node_id)
    except UNREACHABLE as exc:
        return {"checked": False, "error": str(exc)}
    sent = len(send_repairs(md, {digest}).repairs) if bad else 0
    if bad:
        log.warning(
            "bad copy of %s on %s: out of the placement, %d repair(s) sent", digest, node_id, sent
        )
    return {"checked": True, "bad": bad, "repairs_sent": sent}
