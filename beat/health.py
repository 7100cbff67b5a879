"""The health sweep: ping every registered node, refresh its alive key and last-seen
time, declare dead the nodes silent past the dead timeout, and re-admit those that
answer again. The repair sweep acts on what this records.

Each node's answer also says how many bad copies its scrub holds in quarantine: a count
the last scrub report did not show (a copy found bad mid-pass) sends a scrub sweep that
only collects the reports, which takes the copy out of the placement and queues its
repair, so a bad copy waits one health interval, not up to a scrub interval. A node newly
declared dead sends a repair sweep the same way: its copies start then, not at the next
repair sweep."""

from __future__ import annotations

from celery.utils.log import get_task_logger

from beat.repair import repair
from beat.scrub import scrub
from beat.sweeps import sweep
from coordinator import config
from coordinator.state import scrub_reports
from coordinator.state.clock import redis_clock
from coordinator.state.liveness import DEAD, UP, node_health, probe_registered
from tasks.context import metadata

log = get_task_logger(__name__)


def run_pass() -> dict[str, int]:
    md = metadata()
    live = probe_registered(md, config.cluster_key())
    now = redis_clock(md.r)  # the clock every last-seen time is written on
    health = node_health(md, config.dead_after(), set(live), now=now)
    counts = {"up": 0, "down": 0, "dead": 0, "newly_dead": 0, "readmitted": 0, "new_bad": 0}
    declared = md.nodes.declared_dead()
    for node_id, h in sorted(health.items()):
        counts[h.state] += 1
        if h.state == DEAD and node_id not in declared and md.nodes.declare_dead(node_id):
            counts["newly_dead"] += 1
            silent = now - h.last_seen if h.last_seen is not None else None
            log.warning(
                "node %s is dead (silent for %s): its copies no longer count, its shards"
                " are copied to the other nodes",
                node_id,
                f"{silent:.0f} s" if silent is not None else "ever since it was added",
            )
        elif h.state == UP and node_id in declared and md.nodes.readmit(node_id):
            counts["readmitted"] += 1
            log.warning("node %s answers again: re-admitted; copies above R are trimmed", node_id)
    if counts["newly_dead"]:
        # Its blobs are below R from now on: their copies start now, not at the next
        # repair sweep (up to REPAIR_INTERVAL_S later; invariant 13).
        repair.apply_async(queue=config.CONTROL_QUEUE)
    reported = scrub_reports.reports(md)
    news = sorted(
        n
        for n, stat in live.items()
        if stat.quarantined != len(reported.get(n, {}).get("quarantined") or [])
    )
    if news:
        counts["new_bad"] = len(news)
        log.warning("bad copies held on %s changed: collecting the scrub reports now", news)
        scrub.apply_async(kwargs={"start": False}, queue=config.CONTROL_QUEUE)
    return counts


@sweep("health")
def health() -> dict[str, int]:
    """One probe of every registered node."""
    return run_pass()
