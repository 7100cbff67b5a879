"""The repair sweep: bring every blob of a committed version (and of a pending version's
shards its store is done with) back to R copies on nodes that are not dead, and trim
copies above R (a dead node that came back). coordinator/state/repair_plan.py decides
from Redis; this sends each step as a task.

send_repairs also runs outside the sweep: for the blobs just found bad (a gather's
report, a scrub report), whose repair is queued at once, and at the end of every repair
task (tasks/repair.py), so the slot a copy frees starts the next copy at once: a lost
node drains continuously, and the sweep only begins the drain and backs it up. One plan
at a time (a Redis lock around plan and claims), and the in-flight records and the task
ids (repair-<first digest>-<target>) keep any two from ever sending the same copy twice.
Copies between the same two nodes go as one task, one session (repair_plan.Plan.sessions)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection

from celery.utils.log import get_task_logger
from redis.exceptions import LockError

from beat.sweeps import sweep
from coordinator import config
from coordinator.state import redis_keys as K
from coordinator.state import repairs
from coordinator.state.clock import redis_clock
from coordinator.state.liveness import node_health, probe_registered
from coordinator.state.metadata import Metadata
from coordinator.state.repair_plan import TRIM, Plan, placements, plan, wanted_blobs
from coordinator.state.versions import digests
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError
from tasks.app import app
from tasks.commit import record_request_order
from tasks.context import REDIS_TRANSIENT, metadata
from tasks.enqueue import repair_time_limit, send_repair, send_trim

log = get_task_logger(__name__)


def send_repairs(md: Metadata, only: Collection[str] | None = None) -> Plan:
    """Decide and send the repairs (and trims) of every wanted blob, or of the blobs in
    `only` (then the nodes not heard from lately are probed first: no sweep may have).
    Plans one at a time: two planners reading the in-flight records at once (a sweep and
    a repair's end, two workers) could each send a copy of one blob to another target.
    Nothing is sent if the lock stays taken for REPAIR_PLAN_LOCK_S (its holder plans)."""
    lock = md.r.lock(
        K.REPAIR_PLAN_LOCK,
        timeout=defaults.REPAIR_PLAN_LOCK_S,
        blocking_timeout=defaults.REPAIR_PLAN_LOCK_S,
    )
    if not lock.acquire():
        log.warning("repair: another plan held the lock for %s s", defaults.REPAIR_PLAN_LOCK_S)
        return Plan()
    try:
        return _plan_and_send(md, only)
    finally:
        with contextlib.suppress(LockError):  # expired under a very slow plan: nothing to free
            lock.release()


def _plan_and_send(md: Metadata, only: Collection[str] | None) -> Plan:
    now = redis_clock(md.r)  # what last-seen times and repair records are written on
    nodes = md.nodes.nodes()
    if only is None:
        # The health sweep keeps these fresh: a pass probes nothing itself.
        alive = md.nodes.alive(nodes)
    else:
        live = probe_registered(md, config.cluster_key(), trust_recent=True)
        alive = {n: dataclasses.asdict(stat) for n, stat in live.items()}
    health = node_health(md, config.dead_after(), set(alive), now=now)
    blobs = wanted_blobs(md)
    if only is not None:
        blobs = {d: b for d, b in blobs.items() if d in only}
    decided = plan(
        blobs,
        placements(md, blobs),
        health,
        {n: int(stat.get("free_bytes", 0)) for n, stat in alive.items()},
        repairs.in_flight(md, now),
        per_node=config.repairs_per_node(),
        max_in_flight=defaults.REPAIRS_MAX_IN_FLIGHT,
        backoff=repairs.waiting_targets(md, now),
    )
    rate = config.repair_bps()
    for session in decided.sessions():
        limit = repair_time_limit(sum(r.size for r in session), rate)
        first = session[0]
        # Recorded before it is sent: the throttle counts its session, and a second sweep
        # (another beat) cannot send the same copy; the records expire if the task dies.
        claimed = [
            r.digest
            for r in session
            if repairs.claim(
                md,
                r.digest,
                r.target,
                r.source,
                r.size,
                limit + config.reconcile_grace(),
                session=f"{first.digest}:{first.target}",
            )
        ]
        if claimed:
            send_repair(claimed[0], first.source, first.target, limit, claimed[1:])
    for digest in decided.trims:
        if repairs.claim(md, digest, TRIM, "", 0, defaults.TRIM_TIME_LIMIT_S):
            send_trim(digest, blobs[digest].replicas)
    return decided


def run_pass() -> dict[str, int]:
    md = metadata()
    decided = send_repairs(md)
    repairs.set_unrepairable(md, decided.unrepairable)
    counts = decided.counts()
    if decided.repairs or decided.trims:
        log.warning("repair: %s", counts)
    return counts


@sweep("repair")
def repair() -> dict[str, int]:
    """One pass over every blob of every committed version."""
    return run_pass()


@app.task(
    name="smoltorrent.replicas",
    bind=True,
    autoretry_for=REDIS_TRANSIENT,
    retry_backoff=defaults.RETRY_BACKOFF_BASE_S,
    retry_jitter=False,
    max_retries=defaults.REPLICAS_RECHECKS,
)
def replicas(self, vkey: str) -> dict[str, int]:
    """Committed version `vkey` asks for another R (`store --replicas` on stored content,
    Versions.set_replicas): the nodes' copies of its manifest learn it, and its blobs are
    copied up to, or trimmed down to, the most any version using them asks for now, not at
    the next sweep. Copies the throttle holds back are sent by this task again, every
    REPLICAS_RECHECK_S, so a store waiting on them needs no beat."""
    md = metadata()
    try:
        blobs = set(digests(md.versions.manifest(vkey)))
    except NotFoundError:
        return {"removed": 1}
    decided = send_repairs(md, blobs)
    record_request_order(md, vkey)
    if decided.throttled or decided.waiting:
        raise self.retry(countdown=defaults.REPLICAS_RECHECK_S)
    return decided.counts()
