"""checksum_sync on a real node process: bad copies quarantined, the pace, the cursor."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from smoltorrent import defaults
from smoltorrent.errors import NodeError
from tests.nodeproc import NodeProcess
from tests.worker_server.conftest import CLUSTER_KEY, SourceBlob

MIB = 1024 * 1024
SCRUB_CHUNK = defaults.SCRUB_CHUNK_BYTES


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def scrub_node(tmp_path: Path) -> Iterator[Callable[[int], NodeProcess]]:
    """scrub_node(rate_bps) -> a keyed node process re-hashing at that rate."""
    started: list[NodeProcess] = []

    def factory(rate_bps: int) -> NodeProcess:
        env = {**os.environ, "SMOLTORRENT_SCRUB_RATE_BPS": str(rate_bps)}
        node = NodeProcess(tmp_path / f"node{len(started)}", CLUSTER_KEY, env=env).start()
        started.append(node)
        return node

    yield factory
    for node in started:
        node.kill()


def flip_byte(node: NodeProcess, digest: str, at: int) -> bytes:
    path = node.data_dir / "blobs" / digest[:2] / digest
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(data)
    return bytes(data)


def test_scrub_quarantines_a_flipped_byte_and_a_good_copy_releases_it(
    scrub_node, make_blob
) -> None:
    node = scrub_node(100 * MIB)
    client = node.client()
    good, bad = make_blob(300_000), make_blob(300_000)
    good.put(client)
    bad.put(client)
    flipped = flip_byte(node, bad.digest, 4321)

    client.scrub()
    wait_until(lambda: client.scrub(start=False)["passes"] >= 1, 60, "a scrub pass")
    status = client.scrub(start=False)
    assert status["quarantined"] == [bad.digest]
    assert status["found_bad"] == 1
    # Out of reads and listings, kept aside byte for byte.
    assert client.has([good.digest, bad.digest]) == {good.digest}
    assert bad.digest not in client.list_blobs()
    with pytest.raises(NodeError) as missing:
        client.get_range(bad.digest, 0, 10)
    assert missing.value.code == "not_found"
    assert (node.data_dir / "quarantine" / bad.digest).read_bytes() == flipped
    assert "quarantined until the coordinator repairs it" in node.log()

    # The node that held the bad copy can take the repair; the bad copy then goes.
    assert bad.put(client) is True
    assert client.scrub(start=False)["quarantined"] == []
    assert client.get_range(bad.digest, 0, 10) == bad.content[:10]


def test_discard_deletes_only_the_quarantined_copy(scrub_node, make_blob) -> None:
    node = scrub_node(100 * MIB)
    client = node.client()
    blob: SourceBlob = make_blob(50_000)
    blob.put(client)
    flip_byte(node, blob.digest, 7)
    assert client.verify([blob.digest]) == [blob.digest]
    assert client.scrub(start=False)["quarantined"] == [blob.digest]
    assert client.discard(blob.digest) is True
    assert client.discard(blob.digest) is False
    assert client.scrub(start=False)["quarantined"] == []
    assert not (node.data_dir / "quarantine" / blob.digest).exists()


def test_scrub_stays_under_its_rate(scrub_node, make_blob) -> None:
    rate = 2 * MIB
    node = scrub_node(rate)
    client = node.client()
    for _ in range(6):
        make_blob(MIB).put(client)
    start = client.scrub()
    assert start["rate_bps"] == rate

    def scrubbed() -> int:
        return client.scrub(start=False)["scrubbed_bytes"]

    wait_until(lambda: scrubbed() > 0, 30, "the scrub to start")
    first, first_at = scrubbed(), time.monotonic()
    wait_until(lambda: scrubbed() >= first + 2 * MIB, 60, "2 MiB scrubbed")
    last, last_at = scrubbed(), time.monotonic()
    measured = (last - first) / (last_at - first_at)
    # Slack: one scrub read may run ahead of the pace, and sampling is not instantaneous.
    assert measured <= rate * 1.25, f"scrubbed at {measured:.0f} bytes/s, limit {rate}"
    wait_until(lambda: client.scrub(start=False)["passes"] >= 1, 60, "the pass to end")
    assert client.scrub(start=False)["scrubbed_bytes"] >= 6 * MIB


def test_a_restarted_node_resumes_its_pass_from_the_cursor(scrub_node, make_blob) -> None:
    rate = MIB
    node = scrub_node(rate)
    client = node.client()
    blobs = [make_blob(MIB // 2) for _ in range(16)]
    for blob in blobs:
        blob.put(client)
    client.scrub()
    cursor = node.data_dir / "scrub_cursor"
    wait_until(lambda: cursor.exists() and '"after": ""' not in cursor.read_text(), 60, "a save")
    node.kill()
    after = cursor.read_text().split('"after": "')[1][:64]
    done_before = sum(1 for blob in blobs if blob.digest <= after)
    assert 0 < done_before < len(blobs)

    node.start()
    client = node.client()
    client.scrub()
    wait_until(lambda: client.scrub(start=False)["passes"] >= 1, 60, "the resumed pass to end")
    scrubbed = client.scrub(start=False)["scrubbed_bytes"]
    assert scrubbed == (len(blobs) - done_before) * (MIB // 2 + len(b"HEADER"))


def test_a_node_scrubbing_at_a_crawl_stops_at_once_and_keeps_its_cursor(
    scrub_node, make_blob
) -> None:
    """At 1 byte/s one chunk's pacing wait is days: SIGTERM ends it, the pass saves its
    cursor before the blob it was reading (not after it: that blob was never fully
    re-hashed) and says so, and the node exits cleanly instead of being cut off."""
    node = scrub_node(1)
    client = node.client()
    make_blob(SCRUB_CHUNK).put(client)
    client.scrub()
    wait_until(lambda: client.scrub(start=False)["scrubbed_bytes"] > 0, 30, "the first chunk")
    assert node.stop() == 0
    assert "scrub pass stopped; the next one resumes after the start" in node.log()
    assert "scrub pass finished" not in node.log()  # a cut-off blob is no finished pass
