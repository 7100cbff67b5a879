"""A gather's reader mark: while it is held, retention leaves the version alone.

The mark is a member of the version's readers zset with an expiry on the Redis
server's clock, refreshed by a thread while the gather runs; a gather killed
mid-way stops refreshing and its mark lapses after GATHER_LEASE_TTL_S, so a
crash blocks a removal for at most that long. Taking the mark is the gather's
"is it committed?" check: retention's script checks the marks in the same
Redis step as its state change, so one of the two always sees the other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from redis.exceptions import RedisError

from coordinator.state.metadata import Metadata
from coordinator.state.versions import COMMITTED
from smoltorrent import defaults
from smoltorrent.errors import GatherError


@contextlib.contextmanager
def reading(md: Metadata, vkey: str, reader: str, what: str) -> Iterator[None]:
    """Hold a reader mark on committed version `vkey` for the body; GatherError naming
    `what` if the version is not committed (pending, removing, gone)."""
    ttl = defaults.GATHER_LEASE_TTL_S
    state = md.removals.start_reading(vkey, reader, ttl)
    if state != COMMITTED:
        raise GatherError(
            f"{what} is {state}, not committed; only committed versions are gathered. "
            "See `smoltorrent ls`."
        )
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(defaults.GATHER_LEASE_REFRESH_S):
            # Redis briefly away: the next refresh tries again, well within the TTL.
            with contextlib.suppress(RedisError):
                md.removals.start_reading(vkey, reader, ttl)

    thread = threading.Thread(target=refresh, name="smoltorrent-reader-mark", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(RedisError):  # if Redis is gone, the mark lapses on its own
            md.removals.stop_reading(vkey, reader)
