"""The one clock every host's records are compared on: the Redis server's."""

from __future__ import annotations

import redis


def redis_clock(r: redis.Redis) -> float:
    """Seconds on the Redis server's clock: one clock for every host. What a sweep
    compares is written on it (a request's age, a remove's, a commit sent, when a node last
    answered), so a host whose clock is off, or stepped, neither hides nor hurries a
    re-drive, nor keeps a dead node's copies counted, nor declares a live one dead."""
    seconds, micros = r.time()
    return seconds + micros / 1e6
