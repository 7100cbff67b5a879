"""The token bucket a limited transfer shares, and the rates --bwlimit understands."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from coordinator import config
from coordinator.dataplane.bandwidth import TokenBucket, WireBytes, WireMeter
from coordinator.dataplane.node_client import KeptConnections, NodeAddress, NodeClient
from smoltorrent import defaults
from smoltorrent.errors import ConfigError

RATE = 4_000_000  # bytes/s
SLICE = 256 * 1024


def _send(directory: str, key: str, count: int) -> None:
    bucket = TokenBucket.shared(RATE, directory, key)
    for _ in range(count):
        bucket.take(SLICE)


def test_processes_sharing_a_bucket_keep_to_one_rate_together(tmp_path):
    """Two processes (as two Celery children sending one store's shards) pay into one
    bucket: together they move at the one rate, not twice it."""
    count = 8  # 2 MiB each, 4 MiB together: about 1 s at RATE
    ctx = multiprocessing.get_context("fork")
    started = time.monotonic()
    workers = [ctx.Process(target=_send, args=(str(tmp_path), "vkey", count)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    elapsed = time.monotonic() - started
    moved = 2 * count * SLICE
    # One bucket each would take half the time; the burst lets 0.1 s of it through at once.
    assert moved / elapsed < 1.3 * RATE, moved / elapsed


def test_a_meter_counts_wire_and_raw_bytes_and_their_ratio():
    meter = WireMeter()
    for n in (SLICE, SLICE, 100):
        meter.wire(n)
    meter.raw(3 * SLICE)
    totals = meter.totals
    assert (totals.raw_bytes, totals.wire_bytes) == (3 * SLICE, 2 * SLICE + 100)
    assert totals.ratio == round(3 * SLICE / (2 * SLICE + 100), 3)
    assert WireBytes().ratio == 1.0  # nothing moved: no gain, no division by zero
    assert WireMeter.limited(0).bucket is None and WireMeter.limited(None).bucket is None


def test_only_a_limited_meter_asks_for_short_slices():
    """A meter that only counts lets each recv be as large as an unmetered one's; a limited
    one is told of every BWLIMIT_SLICE_BYTES at most, so its bucket keeps bursts short."""
    assert WireMeter.limited(None).slice_bytes is None
    assert WireMeter.limited(RATE).slice_bytes == SLICE == defaults.BWLIMIT_SLICE_BYTES


def test_a_paced_client_takes_its_slices_from_its_meter():
    """The client asks its meter for both the pace and the slice size: a caller cannot
    pass a meter that only counts with the limit's short slices (how the store kept
    slicing for nothing after the gather stopped)."""
    client = NodeClient(NodeAddress("127.0.0.1", 1))
    counting, limited = WireMeter.limited(None), WireMeter.limited(RATE)
    assert client.paced(counting).slice_bytes is None
    assert client.paced(limited).slice_bytes == SLICE
    assert client.paced(limited).keeping(KeptConnections()).slice_bytes == SLICE
    client.paced(counting).pace(7)
    assert counting.totals.wire_bytes == 7
    assert client.pace is None


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("50M", 50_000_000),
        ("12.5MB/s", 12_500_000),
        ("8MiB", 8 * 2**20),
        ("400Mbit", 50_000_000),
        ("100mbit/s", 12_500_000),
        ("750k", 750_000),
        ("0", 0),
    ],
)
def test_rates_are_bytes_per_second_decimal_binary_or_bits(text, rate):
    assert config.parse_rate(text) == rate


@pytest.mark.parametrize("text", ["fast", "-5M", "100mbps", "5 apples"])
def test_a_rate_it_cannot_read_says_how_to_write_one(text):
    with pytest.raises(ValueError, match="50M"):
        config.parse_rate(text)


def test_the_cluster_default_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(config.BWLIMIT_ENV, raising=False)
    assert config.bwlimit() is None and config.bwlimit_for(None) == 0
    monkeypatch.setenv(config.BWLIMIT_ENV, "20M")
    assert config.bwlimit_for(None) == 20_000_000
    assert config.bwlimit_for(0) == 0  # a request that names no limit has none
    monkeypatch.setenv(config.BWLIMIT_ENV, "lots")
    with pytest.raises(ConfigError, match=config.BWLIMIT_ENV):
        config.bwlimit()
