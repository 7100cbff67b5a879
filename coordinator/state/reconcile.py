"""What the reconcile sweep must do: desired state (requests, versions) against what
the tasks left behind, decided from Redis alone.

The sweep (beat/reconcile.py) runs this on a schedule and at every worker start and
sends what it returns; every step it can send is idempotent, so sending one twice
costs work, never correctness. Celery's own redelivery of a dead worker's messages
waits for the visibility timeout (hours): a backstop, not the mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.state.metadata import Metadata
from coordinator.state.requests import IN_PROCESS, QUEUED, RUNNING
from coordinator.state.versions import PENDING, REMOVING


def _open_requests(md: Metadata) -> list[tuple[str, dict[str, str]]]:
    """The open requests a task runs: the ones the sweep may send again."""
    found = md.requests.open_requests()
    return [(rid, r) for rid, r in found if r.get("kind") not in IN_PROCESS]


@dataclass
class Actions:
    """Everything one pass decided; the sweep turns each into a task message."""

    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    transfers: list[str] = field(default_factory=list)  # vkeys whose unsettled transfers go
    commits: list[str] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)  # (vkey, reason)
    removes: list[str] = field(default_factory=list)
    # vkey -> its shards a live task is moving: the transfers sent leave them out
    busy: dict[str, set[int]] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in vars(self).items() if k != "busy"}


@dataclass(frozen=True)
class Held:
    """What live tasks hold right now (running, or waiting in a queue): they will do it,
    so it is not sent again."""

    requests: frozenset[str] = frozenset()  # request ids (a store or gather task's id)
    shards: frozenset[tuple[str, int]] = frozenset()  # (vkey, shard) a delivery task moves
    commits: frozenset[str] = frozenset()  # vkeys whose commit task is there


def plan(
    md: Metadata,
    now: float,
    *,
    grace: float,
    stale_after,
    deadline: float,
    started_host: str | None = None,
    held: Held | None = None,
) -> Actions:
    """Decide one pass. `started_host` names a host whose worker has just started: its
    open requests and pending versions have no live task at all, so they go now.
    `held`: the requests whose task is still in the broker (queued, or fetched by a
    worker); a queued one of those is waiting its turn, not lost, so it does not go.
    `stale_after(vkey, version)` is how long a pending version may go without any
    transfer activity before its unsettled transfers are sent again."""
    out = Actions()
    if started_host is not None:
        # Nothing of this host can still be running: send everything it left now.
        out.requests = [(rid, r) for rid, r in _open_requests(md) if r.get("host") == started_host]
        for vkey, v in md.listing.versions_in(PENDING):
            if v.get("host") == started_host:
                (out.commits if md.transfers.barrier_complete(vkey) else out.transfers).append(vkey)
        return out
    boots = md.nodes.worker_boots()
    for rid, rec in _open_requests(md):
        host, state = rec.get("host"), rec.get("state")
        since = float(rec.get("started_at") or rec.get("created_at") or now)
        # A request can only run once its host has a worker; one running under another
        # boot id was left by a worker that died, one still queued may have been taken
        # off the queue by it, unless its message is still there (a backlog).
        lost = held is None or rid not in held.requests
        orphaned = (state == QUEUED and lost) or (
            state == RUNNING and rec.get("boot") != boots.get(host)
        )
        if host in boots and orphaned and now - since > grace:
            out.requests.append((rid, rec))
    for vkey, v in md.listing.versions_in(PENDING, REMOVING):
        if v["state"] == REMOVING:
            if now - float(v.get("removing_at") or 0) > grace:
                out.removes.append(vkey)
        elif md.transfers.barrier_complete(vkey):
            if now - float(v.get("commit_enqueued") or 0) > grace:
                out.commits.append(vkey)
        elif now - float(v.get("created_at") or now) > deadline:
            out.aborts.append((vkey, f"still pending after {deadline:.0f} s; store it again"))
        elif now - md.transfers.last_activity(vkey, v) > stale_after(vkey, v):
            out.transfers.append(vkey)
    return out


def plan_reconnected(md: Metadata, host: str, held: Held) -> Actions:
    """Decide for a worker of `host` whose broker connection came back. Celery dropped the
    messages it had fetched and not started (prefetched, or retries waiting out their
    countdown) and could not give them back to a dead broker, so everything of this host
    that no live task holds goes again now; what one holds is left to it. `held` must be
    read before this runs: a task finishing in between has then settled what it did."""
    out = Actions()
    out.requests = [
        (rid, r)
        for rid, r in _open_requests(md)
        if r.get("host") == host and rid not in held.requests
    ]
    for vkey, v in md.listing.versions_in(PENDING):
        if v.get("host") != host or v.get("request_id") in held.requests:
            continue  # a store task still running sends this version's transfers itself
        if md.transfers.barrier_complete(vkey):
            if vkey not in held.commits:
                out.commits.append(vkey)
            continue
        settled = md.transfers.settled(vkey)
        busy = {shard for k, shard in held.shards if k == vkey}
        open_shards = {
            shard
            for shard, nodes in enumerate(md.transfers.plan(vkey))
            if any(f"{shard}:{r}" not in settled for r in range(len(nodes)))
        }
        if open_shards - busy:
            out.transfers.append(vkey)
            out.busy[vkey] = busy
    return out
