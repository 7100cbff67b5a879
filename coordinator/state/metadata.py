"""The metadata in Redis, as rooms over one client: each room a module of its own.

    md.versions      versions, their states, current version and request order (versions.py)
    md.transfers     a pending version's plan, spans, attempts and commit barrier (transfers.py)
    md.removals      removes of versions (rm, retention) and reader marks (removals.py)
    md.blobs         references, tombstones, placement, orphans, bad copies (blobs.py)
    md.chunks        which blob holds each raw chunk, for a store's dedup (chunks.py)
    md.requests      requests (intents) and the sequence counter (requests.py)
    md.nodes         node records, liveness, worker boots (nodes.py)
    md.listing       what `ls` and `status` read (listing.py)
    md.dead_letters  tasks that failed for good (dead_letters.py)
    md.sweeps        runs of the beat sweeps, and the Redis clock (sweeps.py)

Every key comes from redis_keys.py. Writes that must be atomic are Lua scripts (one file
a script under lua/, loaded by scripts.py) or MULTI blocks, so a retry, a redelivery or
two workers racing leave the same state.
"""

from __future__ import annotations

import redis

from coordinator import config
from coordinator.state.blobs import Blobs
from coordinator.state.chunks import Chunks
from coordinator.state.dead_letters import DeadLetters
from coordinator.state.embedded_redis import NO_CLIENT_INFO
from coordinator.state.listing import Listing
from coordinator.state.nodes import Nodes
from coordinator.state.removals import Removals
from coordinator.state.requests import Requests
from coordinator.state.sweeps import Sweeps
from coordinator.state.transfers import Transfers
from coordinator.state.versions import Versions
from smoltorrent import defaults
from smoltorrent.errors import MetadataError


class Metadata:
    """The connection to Redis and its rooms; nothing else."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.r = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=defaults.REDIS_TIMEOUT_S,
            socket_connect_timeout=defaults.REDIS_TIMEOUT_S,
            **NO_CLIENT_INFO,
        )
        self.versions = Versions(self.r)
        self.transfers = Transfers(self.r, self.versions)
        self.removals = Removals(self.r)
        self.blobs = Blobs(self.r)
        self.chunks = Chunks(self.r)
        self.requests = Requests(self.r)
        self.nodes = Nodes(self.r)
        self.listing = Listing(self.r)
        self.dead_letters = DeadLetters(self.r)
        self.sweeps = Sweeps(self.r)

    def close(self) -> None:
        """Close the client's connections (a long-lived process that makes many clients,
        a test run, would otherwise hold a socket for each)."""
        self.r.close()

    def ping(self) -> None:
        try:
            self.r.ping()
        except redis.RedisError as exc:
            raise MetadataError(
                f"cannot reach Redis at {config.shown_url(self.url)} ({exc}): "
                + config.redis_advice()
            ) from exc
