"""Wake-ups: whoever ends what a client waits for (a request closed, a version committed)
pushes to a Redis list the client blocks on, so it learns the end at once instead of at its
next poll (a tenth of a second on every CLI store and gather).

A hint only. The waiter reads the state itself after every wake-up and blocks at most one
poll interval for one, so a wake-up lost (pushed to a Redis that then restarted, expired
before a slow waiter got there, taken by a second waiter of the same version) costs one
poll, never an outcome; a stale one (a version committed again) costs one extra read. A
list, not pub/sub: a push made between the waiter's last read and its block is still there.
"""

from __future__ import annotations

import time

import redis

from smoltorrent import defaults

# below this much time left, a block would round up to Redis's 1 ms anyway
_MIN_BLOCK_S = 0.001


def queue_wake(p: redis.client.Pipeline, key: str) -> None:
    """Add the wake-up on `key` to pipeline `p` (beside the change it announces)."""
    p.rpush(key, 1)
    p.expire(key, defaults.WAKE_TTL_S)


def wake(r: redis.Redis, key: str) -> None:
    """Wake the waiter on `key`, if any: one round trip."""
    with r.pipeline(transaction=False) as p:
        queue_wake(p, key)
        p.execute()


def wait(r: redis.Redis, key: str, seconds: float) -> bool:
    """Block up to `seconds` for a wake-up on `key`, taking it; whether one came."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > _MIN_BLOCK_S:
        if r.blpop([key], timeout=min(left, defaults.WAKE_BLOCK_SLICE_S)):
            return True
    return False
