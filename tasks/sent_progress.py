"""Bytes of a shard sent so far, recorded for the CLI's store progress bar, and each
delivery task's meter: the store's bandwidth limit and its raw and wire bytes.

A running transfer or chain writes how far its send has got to Redis
(version:{vkey}:sent, "shard:replica" -> bytes), and wait_store counts those with the
settled replicas, so the bar moves as bytes leave instead of a whole shard at a time.
Each delivery task adds what it delivered and put on the wire to version:{vkey}:wire.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from functools import partial

from coordinator import config
from coordinator.dataplane.bandwidth import WireMeter
from smoltorrent import defaults
from tasks.context import REDIS_TRANSIENT


def delivery_meter(version: dict[str, str], vkey: str) -> WireMeter:
    """The meter of one delivery task of version `vkey`: its sends share one bucket with
    every other delivery of the same store on this host (other Celery children)."""
    return WireMeter.limited(
        config.bwlimit_for(version.get("bwlimit")), config.home() / "bwlimit", vkey
    )


def record_wire(md, vkey: str, meter: WireMeter) -> None:
    """Add what a delivery task moved to its version's totals (best effort, as progress)."""
    totals = meter.totals
    if totals.wire_bytes or totals.raw_bytes:
        with contextlib.suppress(*REDIS_TRANSIENT):
            md.transfers.record_wire(vkey, totals.raw_bytes, totals.wire_bytes)


def sent_recorder(md, vkey: str, shard: int) -> Callable[[Sequence[int], int], None]:
    """record(replicas, n): the send now feeding `replicas` of `shard` has sent n bytes (a
    chain feeds all its nodes with one send: they receive the bytes as the head does).
    See SentRecorder."""
    return SentRecorder(md, vkey).of(shard)


class SentRecorder:
    """Records how far a delivery task's sends have got, for any of its shards: written at
    most every STORE_PROGRESS_INTERVAL_S for the whole task (a batch of small chunks writes
    a few times, not once per chunk). Best effort: a Redis hiccup costs a bar update,
    never the transfer."""

    def __init__(self, md, vkey: str) -> None:
        self._md, self._vkey, self._last = md, vkey, 0.0

    def of(self, shard: int) -> Callable[[Sequence[int], int], None]:
        return partial(self.record, shard)

    def record(self, shard: int, replicas: Sequence[int], sent: int) -> None:
        now = time.monotonic()
        if now - self._last < defaults.STORE_PROGRESS_INTERVAL_S:
            return
        self._last = now
        with contextlib.suppress(*REDIS_TRANSIENT):  # a chain's replicas in one round trip
            self._md.transfers.record_sent(
                self._vkey, {f"{shard}:{replica}": sent for replica in replicas}
            )
