"""Sweep runs: the last runs of each beat sweep and how often one stood down, on the Redis
server's clock (one clock for every host)."""

from __future__ import annotations

import json

import redis

from coordinator.state import redis_keys as K
from smoltorrent import defaults


def redis_clock(r: redis.Redis) -> float:
    """Seconds on the Redis server's clock: one clock for every host. What the reconcile
    sweep compares (a request's age, a remove's, a commit sent) is written on it, so a
    host whose clock is off, or stepped, neither hides nor hurries a re-drive."""
    seconds, micros = r.time()
    return seconds + micros / 1e6


class Sweeps:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def redis_time(self) -> float:
        """Seconds on the Redis server's clock: one clock for every host."""
        return redis_clock(self.r)

    def sweep_ran(self, name: str, started: float, by: str, outcome: str) -> None:
        """Record one run of a sweep (its last SWEEP_RUNS_KEPT are kept)."""
        key = K.SWEEP_RUNS.format(name=name)
        run = {"started": started, "finished": self.redis_time(), "by": by, "outcome": outcome}
        with self.r.pipeline() as p:
            p.rpush(key, json.dumps(run))
            p.ltrim(key, -defaults.SWEEP_RUNS_KEPT, -1)
            p.execute()

    def sweep_runs(self, name: str) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(K.SWEEP_RUNS.format(name=name), 0, -1)]

    def sweep_skipped(self, name: str) -> None:
        self.r.incr(K.SWEEP_SKIPPED.format(name=name))

    def sweep_skips(self, name: str) -> int:
        return int(self.r.get(K.SWEEP_SKIPPED.format(name=name)) or 0)
