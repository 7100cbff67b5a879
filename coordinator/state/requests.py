"""Requests (intents): each store, gather or remove asked for is recorded before its task
is queued, with a sequence number from the one counter that also orders a name's
versions; a worker marks it running, then done or failed.

States: queued until a task picks it up, running, then done or failed.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from coordinator.state import redis_keys as K
from coordinator.state.clock import redis_clock
from coordinator.state.scripts import load
from coordinator.state.wakeups import queue_wake
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
# The kind of a gather that the process asking for it runs itself (a reader with no
# worker; tasks/requests.py): no task stands behind it, so the reconcile sweep never
# sends one for it.
IN_PROCESS_GATHER = "gather-in-process"
# The kind of a store that the process asking for it runs itself (a rank's writer on a
# host no worker serves; tasks/requests.py): the store task's own code, in that process.
IN_PROCESS_STORE = "store-in-process"
IN_PROCESS = (IN_PROCESS_GATHER, IN_PROCESS_STORE)  # no task stands behind either


@dataclass(frozen=True)
class Start:
    """What start_request found. `holder`: another run holds the request's lease (for
    `lease_left_s` more): this delivery must not run it now."""

    found: str  # the state found: queued, running, failed, done or missing
    holder: str = ""
    lease_left_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.found == DONE


def next_seq(r: redis.Redis) -> int:
    """A new sequence number from the one counter that orders requests."""
    return int(r.incr(K.SEQ))


class Requests:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._open = load(r, "requests/open")
        self._start = load(r, "requests/start")
        self._renew = load(r, "requests/renew")

    def next_seq(self) -> int:
        """A new sequence number from the one counter that orders requests."""
        return next_seq(self.r)

    def open_request(self, rid: str, kind: str, host: str, args: dict) -> int:
        """Record a request before its task is queued; its sequence number."""
        return int(
            self._open(
                keys=[K.SEQ, K.REQUEST.format(rid=rid), K.REQUESTS_OPEN],
                args=[kind, host, json.dumps(args), redis_clock(self.r), rid],
            )
        )

    def request(self, rid: str) -> dict[str, str]:
        data = self.r.hgetall(K.REQUEST.format(rid=rid))
        if not data:
            raise NotFoundError(f"no request {rid} in the metadata.")
        return data

    def start_request(
        self,
        rid: str,
        boot: str,
        owner: str | None = None,
        *,
        dead_owner: str = "",
        lease_s: float = defaults.REQUEST_LEASE_S,
    ) -> Start:
        """Mark a request running by `owner` (a run of the worker started as `boot`) and
        give it the request's lease, unless another run holds it (Start.holder) or an
        earlier run finished it (Start.done: do not run it again). `dead_owner`: a run
        the caller knows is dead, whose lease it takes at once."""
        found, holder, left_ms = self._start(
            keys=[K.REQUEST.format(rid=rid)],
            args=[boot, redis_clock(self.r), owner or boot, int(lease_s * 1000), dead_owner],
        )
        return Start(found, holder, int(left_ms) / 1000)

    def renew_lease(self, rid: str, owner: str, lease_s: float) -> bool:
        """Extend `owner`'s lease on a running request (lease_s 0 drops it); False if it
        no longer holds it."""
        args = [owner, int(lease_s * 1000)]
        return bool(self._renew(keys=[K.REQUEST.format(rid=rid)], args=args))

    @contextlib.contextmanager
    def holding(self, rid: str, owner: str) -> Iterator[None]:
        """Keep `owner`'s lease on the request while the body runs (a thread renews it);
        dropped when the body ends, so a retry of the task takes it at once. A run killed
        stops renewing and its lease lapses after REQUEST_LEASE_S."""
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(defaults.REQUEST_LEASE_REFRESH_S):
                # Redis briefly away: the next renewal tries again, well within the lease.
                with contextlib.suppress(redis.RedisError):
                    self.renew_lease(rid, owner, defaults.REQUEST_LEASE_S)

        thread = threading.Thread(target=renew, name="smoltorrent-request-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            with contextlib.suppress(redis.RedisError):  # if Redis is gone, it lapses anyway
                self.renew_lease(rid, owner, 0)

    def finish_request(self, rid: str, state: str, **fields) -> None:
        """Close a request as done or failed, with what its caller needs to know; it stays
        readable for REQUEST_TTL_S. Its waiter, if any, is woken (wakeups.py)."""
        with self.r.pipeline() as p:
            p.hset(
                K.REQUEST.format(rid=rid),
                mapping={"state": state, "finished_at": time.time(), **fields},
            )
            p.expire(K.REQUEST.format(rid=rid), defaults.REQUEST_TTL_S)
            p.zrem(K.REQUESTS_OPEN, rid)
            queue_wake(p, K.REQUEST_WAKE.format(rid=rid))
            p.execute()

    def open_requests(self) -> list[tuple[str, dict[str, str]]]:
        """(request id, record) of every request not yet done or failed, oldest first."""
        rids = self.r.zrange(K.REQUESTS_OPEN, 0, -1)
        with self.r.pipeline(transaction=False) as p:
            for rid in rids:
                p.hgetall(K.REQUEST.format(rid=rid))
            records = p.execute()
        return [(rid, rec) for rid, rec in zip(rids, records, strict=True) if rec]
