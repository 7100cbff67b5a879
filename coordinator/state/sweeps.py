"""Sweep runs: the last runs of each beat sweep and how often one stood down, on the Redis
server's clock (one clock for every host)."""

from __future__ import annotations

import json

import redis

from coordinator.state import redis_keys as K
from coordinator.state.clock import redis_clock
from smoltorrent import defaults


def lock_holder(host: str, boot: str, run: str) -> str:
    """What a sweep's lock holds: the host and worker boot of the process running it, so
    the next boot of that host's worker can tell the lock was left by the dead."""
    return f"{host} {boot} {run}"


class Sweeps:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def free_locks_of_dead_boots(self, names: list[str], host: str, boot: str) -> list[str]:
        """Delete the locks of sweeps `names` that an earlier boot of `host`'s worker held
        (its processes died with it: a SIGKILL, the OOM killer), so those sweeps run again
        now, not once the lock expires. The sweeps freed. A lock replaced meanwhile by a
        live holder is left to it."""
        freed = []
        for name in names:
            key = K.SWEEP_LOCK.format(name=name)
            with self.r.pipeline() as p:
                try:
                    p.watch(key)
                    held_by = (p.get(key) or "").split(" ")
                    if len(held_by) != 3 or held_by[0] != host or held_by[1] == boot:
                        continue
                    p.multi()
                    p.delete(key)
                    p.execute()
                    freed.append(name)
                except redis.WatchError:
                    continue
        return freed

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
