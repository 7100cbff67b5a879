"""Repair tasks: one node-to-node repair session (a blob, or several with the same source
and target, over one connection), one trim of a blob's surplus copies.

Both are sent by beat/repair.py send_repairs, which records each in flight first;
whatever happens, the task frees that record, and a failure is only logged and puts its
target in backoff (coordinator/state/repairs.py): the next plan decides again from fresh
liveness, so a failed copy is retried by another target or after the backoff, never in
a loop, and never becomes a dead letter. A copy that ends, well or not, plans and sends
the next ones itself (send_repairs): its slot is free now, and the blobs still below R
must not wait for the next sweep (invariant 13).
"""

from __future__ import annotations

from celery.utils.log import get_task_logger

from beat.repair import send_repairs
from coordinator import config
from coordinator.state import repairs
from coordinator.state.clock import redis_clock
from coordinator.state.healing import copy_blobs, trim_blob
from coordinator.state.repair_plan import TRIM
from smoltorrent import defaults
from smoltorrent.errors import NodeError, NodeUnavailableError, ProtocolError
from tasks.app import app
from tasks.context import BOOT_ID, REDIS_TRANSIENT, metadata

log = get_task_logger(__name__)

NODE_FAILURES = (NodeUnavailableError, NodeError, ProtocolError)


@app.task(
    name="smoltorrent.repair",
    bind=True,
    autoretry_for=REDIS_TRANSIENT,
    retry_backoff=defaults.RETRY_BACKOFF_BASE_S,
    retry_jitter=False,
    max_retries=config.transfer_retries(),
    default_retry_delay=defaults.RETRY_BACKOFF_BASE_S,
)
def repair(
    self, digest: str, source: str, target: str, more: list[str] | None = None
) -> str | dict[str, str]:
    """Copy digest (and `more`: blobs with the same source and target, one session) from
    source to target. The outcome's word (copy_blobs) for one blob, or digest -> word."""
    md = metadata()
    digests = [digest, *(more or [])]
    try:
        repairs.running(md, digest, target, more or [], config.host_id(), BOOT_ID)
        nodes = md.nodes.nodes()
        if source not in nodes or target not in nodes:
            return "node removed"
        outcomes = copy_blobs(
            md, nodes, config.cluster_key(), digests, source, target, config.repair_bps()
        )
        # Before the next plan (below): a copy that failed must be backing off by then.
        for d, how in outcomes.items():
            if how in ("stored", "exists"):
                repairs.succeeded(md, d, target)
            elif how.startswith("failed: "):
                repairs.failed(md, d, target, how.removeprefix("failed: "))
                log.warning("repair of %s from %s to %s %s", d, source, target, how)
    except NODE_FAILURES as exc:
        for d in digests:
            until = repairs.failed(md, d, target, str(exc))
        log.warning(
            "repair of %d blob(s) from %s to %s failed: %s; that target waits %.0f s",
            len(digests),
            source,
            target,
            exc,
            until - redis_clock(md.r),
        )
        return f"failed: {exc}"
    finally:
        repairs.finished(md, digest, target, more or [])
        _next_repairs(md)
    return outcomes[digest] if not more else outcomes


def _next_repairs(md) -> None:
    """This repair's slot is free: send what waits for one now. A failure here is only
    logged: the repair sweep sends it at the latest."""
    try:
        send_repairs(md)
    except REDIS_TRANSIENT as exc:
        log.warning("the repairs after this one wait for the next sweep: %s", exc)


@app.task(
    name="smoltorrent.trim",
    bind=True,
    autoretry_for=REDIS_TRANSIENT,
    retry_backoff=defaults.RETRY_BACKOFF_BASE_S,
    retry_jitter=False,
    max_retries=config.transfer_retries(),
    default_retry_delay=defaults.RETRY_BACKOFF_BASE_S,
)
def trim(self, digest: str, replicas: int) -> dict:
    md = metadata()
    try:
        nodes = md.nodes.nodes()
        return trim_blob(md, nodes, config.cluster_key(), digest, replicas, md.nodes.alive(nodes))
    finally:
        repairs.finished(md, digest, TRIM)
