"""Requests (intents): each store, gather or remove asked for is recorded before its task
is queued, with a sequence number from the one counter that also orders a name's
versions; a worker marks it running, then done or failed.

States: queued until a task picks it up, running, then done or failed.
"""

from __future__ import annotations

import json
import time

import redis

from coordinator.state import redis_keys as K
from coordinator.state.scripts import load
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
# The kind of a gather that the process asking for it runs itself (a reader with no
# worker; tasks/requests.py): no task stands behind it, so the reconcile sweep never
# sends one for it.
IN_PROCESS_GATHER = "gather-in-process"


def next_seq(r: redis.Redis) -> int:
    """A new sequence number from the one counter that orders requests."""
    return int(r.incr(K.SEQ))


class Requests:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._open = load(r, "requests/open")
        self._start = load(r, "requests/start")

    def next_seq(self) -> int:
        """A new sequence number from the one counter that orders requests."""
        return next_seq(self.r)

    def open_request(self, rid: str, kind: str, host: str, args: dict) -> int:
        """Record a request before its task is queued; its sequence number."""
        return int(
            self._open(
                keys=[K.SEQ, K.REQUEST.format(rid=rid), K.REQUESTS_OPEN],
                args=[kind, host, json.dumps(args), time.time(), rid],
            )
        )

    def request(self, rid: str) -> dict[str, str]:
        data = self.r.hgetall(K.REQUEST.format(rid=rid))
        if not data:
            raise NotFoundError(f"no request {rid} in the metadata.")
        return data

    def start_request(self, rid: str, boot: str) -> str:
        """Mark a request running by the worker started as `boot`; the state found
        ("done" means an earlier run finished it: do not run it again)."""
        return self._start(keys=[K.REQUEST.format(rid=rid)], args=[boot, time.time()])

    def finish_request(self, rid: str, state: str, **fields) -> None:
        """Close a request as done or failed, with what its caller needs to know; it stays
        readable for REQUEST_TTL_S."""
        with self.r.pipeline() as p:
            p.hset(
                K.REQUEST.format(rid=rid),
                mapping={"state": state, "finished_at": time.time(), **fields},
            )
            p.expire(K.REQUEST.format(rid=rid), defaults.REQUEST_TTL_S)
            p.zrem(K.REQUESTS_OPEN, rid)
            p.execute()

    def open_requests(self) -> list[tuple[str, dict[str, str]]]:
        """(request id, record) of every request not yet done or failed, oldest first."""
        rids = self.r.zrange(K.REQUESTS_OPEN, 0, -1)
        with self.r.pipeline(transaction=False) as p:
            for rid in rids:
                p.hgetall(K.REQUEST.format(rid=rid))
            records = p.execute()
        return [(rid, rec) for rid, rec in zip(rids, records, strict=True) if rec]
