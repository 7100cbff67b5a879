"""The repair sweep: bring every blob of a committed version back to R copies on nodes
that are not dead, and trim copies above R (a dead node that came back).
coordinator/state/repair_plan.py decides from Redis; this sends each step as a task."""

from __future__ import annotations

import time

from celery.utils.log import get_task_logger

from beat.sweeps import sweep
from coordinator import config
from coordinator.state import repairs
from coordinator.state.liveness import node_health
from coordinator.state.repair_plan import TRIM, placements, plan, wanted_blobs
from smoltorrent import defaults
from tasks.context import metadata
from tasks.enqueue import send_repair, send_trim, transfer_time_limit

log = get_task_logger(__name__)


def run_pass() -> dict[str, int]:
    md = metadata()
    now = time.time()
    nodes = md.nodes()
    # The health sweep keeps these fresh: this pass probes nothing itself.
    alive = md.alive(nodes)
    health = node_health(md, now, config.dead_after(), set(alive))
    blobs = wanted_blobs(md)
    decided = plan(
        blobs,
        placements(md, blobs),
        health,
        {n: int(stat.get("free_bytes", 0)) for n, stat in alive.items()},
        repairs.in_flight(md, now),
        per_node=config.repairs_per_node(),
        max_in_flight=defaults.REPAIRS_MAX_IN_FLIGHT,
    )
    for r in decided.repairs:
        limit = transfer_time_limit(r.size)
        # Recorded before it is sent: the throttle counts it, and a second sweep (another
        # beat) cannot send the same copy; the record expires if the task dies.
        if repairs.claim(
            md, r.digest, r.target, r.source, r.size, limit + config.reconcile_grace()
        ):
            send_repair(r.digest, r.source, r.target, limit)
    for digest in decided.trims:
        if repairs.claim(md, digest, TRIM, "", 0, defaults.TRIM_TIME_LIMIT_S):
            send_trim(digest, blobs[digest].replicas)
    repairs.set_unrepairable(md, decided.unrepairable)
    counts = decided.counts()
    if decided.repairs or decided.trims:
        log.warning("repair: %s", counts)
    return counts


@sweep("repair")
def repair() -> dict[str, int]:
    """One pass over every blob of every committed version."""
    return run_pass()
