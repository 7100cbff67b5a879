"""The scrub sweep (checksum_sync): every node re-hashes its blobs at its bounded rate
(worker_server/scrub.py); this sweep starts a pass on each node where none runs, reads
what each found, takes the bad copies out of the placement so the repair sweep copies
them again, and discards a bad copy once a good one is counted on another node. Copies a
gather found corrupt are re-hashed by their nodes here too."""

from __future__ import annotations

import time

from celery.utils.log import get_task_logger

from beat.sweeps import sweep
from coordinator import config
from coordinator.dataplane.node_client import NodeClient
from coordinator.state import scrub_reports
from coordinator.state.healing import UNREACHABLE, check_reported_bad, settle_quarantined
from coordinator.state.liveness import DEAD, node_health
from tasks.context import metadata

log = get_task_logger(__name__)


def run_pass(*, start: bool = True) -> dict[str, int]:
    """Ask every up node for its scrub report (and, with `start`, to start a pass if
    none runs); act on the bad copies reported."""
    md = metadata()
    nodes = md.nodes()
    alive = md.alive(nodes)
    health = node_health(md, time.time(), config.dead_after(), set(alive))
    counted = {n for n, h in health.items() if h.state != DEAD}
    key = config.cluster_key()
    counts = {"nodes": 0, "quarantined": 0, "released": 0, "discarded": 0, "reported_bad": 0}
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
    counts["reported_bad"] = len(check_reported_bad(md, nodes, key))
    if counts["released"] or counts["discarded"] or counts["reported_bad"]:
        log.warning("scrub: %s", counts)
    return counts


@sweep("scrub")
def scrub() -> dict[str, int]:
    """One round of every node's scrub reports."""
    return run_pass()
