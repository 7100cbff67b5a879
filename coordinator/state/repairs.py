"""Repair records in Redis: copies in flight (the throttle), blobs no repair can raise
now (shown by `status`), targets backing off after a failed copy, and the one step that
makes a repaired copy count.

A copy that fails (the target errs, times out, or its task dies) puts its (blob, target)
in backoff: REPAIR_BACKOFF_S after the first failure, doubling with each further one up
to REPAIR_BACKOFF_MAX_S, so a target that keeps failing is not sent the same copy every
sweep; another target may take it meanwhile. A copy that succeeds clears it.

A repaired copy joins the placement only after its target verified it, and only while
some version still uses the blob and no remove is deleting it (one script, so a remove
racing the repair cannot leave a copy of a removed blob in the placement).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from coordinator import config
from coordinator.state import redis_keys as K
from coordinator.state.clock import redis_clock
from coordinator.state.metadata import Metadata
from coordinator.state.scripts import load


@dataclass(frozen=True)
class InFlight:
    digest: str
    target: str
    source: str
    size: int
    at: float
    deadline: float
    session: str = ""  # the copies sent in one session (one task) share it; "" if alone


def _field(digest: str, target: str) -> str:
    return f"{digest}:{target}"


def placed(md: Metadata, digest: str, node_id: str) -> bool:
    """Count node_id's verified copy of digest; False if no version uses the blob now."""
    keys = [
        K.PLACEMENT.format(digest=digest),
        K.BLOB_REFS.format(digest=digest),
        K.BLOB_DELETING.format(digest=digest),
        K.PLACEMENTS_LISTED,
    ]
    return bool(load(md.r, "repairs/placed")(keys=keys, args=[node_id, digest]))


def claim(
    md: Metadata,
    digest: str,
    target: str,
    source: str,
    size: int,
    limit_s: float,
    session: str = "",
) -> bool:
    """Record a repair about to be sent (in `session`, the task that carries it with
    others); False if the same copy is in flight already."""
    now = redis_clock(md.r)
    record = {"source": source, "size": size, "at": now, "deadline": now + limit_s}
    if session:
        record["session"] = session
    return bool(md.r.hsetnx(K.REPAIRS, _field(digest, target), json.dumps(record)))


def running(md: Metadata, digest: str, target: str, more: list[str], host: str, boot: str) -> None:
    """The repair session of digest and `more` runs in the worker of `host` started as
    `boot`: if that worker dies, its next boot frees the session (free_dead_sessions)."""
    runner = {"host": host, "boot": boot, "at": redis_clock(md.r), "digests": [digest, *more]}
    md.r.hset(K.REPAIR_RUNNERS, _field(digest, target), json.dumps({**runner, "target": target}))


def finished(md: Metadata, digest: str, target: str, more: list[str] = ()) -> None:
    """The repair (of digest and `more`, one session's) ended, well or not: its records
    are gone, and its session slot is free."""
    with md.r.pipeline() as p:
        p.hdel(K.REPAIRS, *(_field(d, target) for d in [digest, *more]))
        p.hdel(K.REPAIR_RUNNERS, _field(digest, target))
        p.execute()


def free_dead_sessions(md: Metadata, host: str, boot: str) -> int:
    """Free the repair sessions an earlier boot of `host`'s worker was running: it died
    with them (a SIGKILL, the OOM killer), and their records would hold the throttle and
    keep their copies from being sent again until their deadlines, minutes away. A record
    claimed after the session started is another session's and stays. How many copies
    were freed. (The dead worker's unacked message comes back after the visibility
    timeout, hours on; a copy is idempotent, so that late run costs only a check.)"""
    freed = 0
    for field, raw in md.r.hgetall(K.REPAIR_RUNNERS).items():
        runner = json.loads(raw)
        if runner["host"] != host or runner["boot"] == boot:
            continue
        fields = [_field(d, runner["target"]) for d in runner["digests"]]
        records = md.r.hmget(K.REPAIRS, fields)
        ours = [f for f, r in zip(fields, records, strict=True) if r and _claimed_by(r, runner)]
        with md.r.pipeline() as p:
            if ours:
                p.hdel(K.REPAIRS, *ours)
            p.hdel(K.REPAIR_RUNNERS, field)
            p.execute()
        freed += len(ours)
    return freed


def _claimed_by(record: str, runner: dict) -> bool:
    """Whether the in-flight record was claimed for the session `runner` ran: before it
    started (a record claimed later is a new session's, sent once the old one expired)."""
    return json.loads(record)["at"] <= runner["at"]


def in_flight(md: Metadata, now: float | None = None) -> list[InFlight]:
    """Repairs sent and not finished; records past their deadline (a task that died) are
    dropped, so the next pass may send them again."""
    now = redis_clock(md.r) if now is None else now
    out, stale = [], []
    for key, raw in md.r.hgetall(K.REPAIRS).items():
        digest, _, target = key.partition(":")
        record = json.loads(raw)
        if record["deadline"] < now:
            stale.append(key)
            continue
        out.append(
            InFlight(
                digest,
                target,
                record["source"],
                record["size"],
                record["at"],
                record["deadline"],
                record.get("session", ""),
            )
        )
    for key in stale:
        # Only the reader that drops the record counts the failure (status and the
        # metrics read this too).
        digest, _, target = key.partition(":")
        if md.r.hdel(K.REPAIRS, key) and target != "trim":
            failed(md, digest, target, "its task ended without finishing", now)
    return out


@dataclass(frozen=True)
class Backoff:
    digest: str
    target: str
    failures: int  # failed copies in a row
    until: float  # unix time before which the copy is not sent to this target again
    error: str  # the last failure


def failed(md: Metadata, digest: str, target: str, error: str, now: float | None = None) -> float:
    """A copy of digest to target failed: back off (doubling); the time it may run again."""
    now = redis_clock(md.r) if now is None else now
    raw = md.r.hget(K.REPAIR_BACKOFF, _field(digest, target))
    failures = (json.loads(raw)["failures"] if raw else 0) + 1
    delay = min(config.repair_backoff() * 2 ** (failures - 1), config.repair_backoff_max())
    record = {"failures": failures, "until": now + delay, "error": error[:500]}
    md.r.hset(K.REPAIR_BACKOFF, _field(digest, target), json.dumps(record))
    return now + delay


def succeeded(md: Metadata, digest: str, target: str) -> None:
    """A copy of digest to target is placed: no backoff left for it."""
    md.r.hdel(K.REPAIR_BACKOFF, _field(digest, target))


def backing_off(md: Metadata, now: float | None = None) -> list[Backoff]:
    """Copies waiting out a backoff now. Records older than the longest backoff (the blob
    was repaired elsewhere, or removed) are dropped: a failure that old starts over."""
    now = redis_clock(md.r) if now is None else now
    out, old = [], []
    for key, raw in md.r.hgetall(K.REPAIR_BACKOFF).items():
        digest, _, target = key.partition(":")
        record = json.loads(raw)
        if record["until"] + config.repair_backoff_max() < now:
            old.append(key)
        elif record["until"] > now:
            out.append(
                Backoff(digest, target, record["failures"], record["until"], record["error"])
            )
    if old:
        md.r.hdel(K.REPAIR_BACKOFF, *old)
    return out


def waiting_targets(md: Metadata, now: float | None = None) -> dict[str, set[str]]:
    """Digest -> targets backing off, as repair_plan.plan takes it."""
    out: dict[str, set[str]] = {}
    for b in backing_off(md, now):
        out.setdefault(b.digest, set()).add(b.target)
    return out


def set_unrepairable(md: Metadata, blobs: dict[str, dict]) -> None:
    """Replace the list of blobs below R that no repair can raise now."""
    with md.r.pipeline() as p:
        p.delete(K.UNREPAIRABLE)
        if blobs:
            p.hset(K.UNREPAIRABLE, mapping={d: json.dumps(v) for d, v in blobs.items()})
        p.execute()


def unrepairable(md: Metadata) -> dict[str, dict]:
    return {d: json.loads(v) for d, v in md.r.hgetall(K.UNREPAIRABLE).items()}


def count(md: Metadata, what: str, n: int = 1) -> None:
    """Add to a repair counter ("repaired", "trimmed", ...)."""
    md.r.hincrby(K.REPAIR_COUNTS, what, n)


def counts(md: Metadata) -> dict[str, int]:
    return {k: int(v) for k, v in md.r.hgetall(K.REPAIR_COUNTS).items()}
