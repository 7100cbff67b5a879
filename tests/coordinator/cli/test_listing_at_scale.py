"""`ls` and `status` over 3,000 versions recorded through the metadata layer, on a real
redis-server: every row right, and the Redis work bounded (a few round trips and one or two
per slice of LISTING_SLICE_VERSIONS, no manifest read, no scan of the keyspace)."""

from __future__ import annotations

import os
import signal

import pytest
import redis

from bench.scale_metadata import CountedMetadata
from coordinator.cli import reports
from coordinator.dataplane.node_client import NodeAddress
from coordinator.local.synthetic import synthetic_manifest
from coordinator.plan.version_ids import storage_key
from coordinator.state import redis_keys as K
from coordinator.state.embedded_redis import start_redis, url_for
from coordinator.state.metadata import Metadata
from smoltorrent import defaults
from tests.nodeproc import start_node

NAMES = 30  # 10,000 are measured by bench/scale_metadata.py; 3,000 are 3 slices and more
VERSIONS_PER_NAME = 100  # 3,000 versions in all
SHARDS = 2
# Round trips one listing may take, whatever the number of versions: summaries (marker,
# rows, states, current, aborted reasons), settled counts, copy counts, scripts loaded.
MAX_ROUND_TRIPS = 12
# Slices of one listing, each a round trip of its own (no one script holds Redis long),
# run twice when it meets placements not yet listed (the first listing); the last may end
# with an empty one.
SLICES = -(-NAMES * VERSIONS_PER_NAME // defaults.LISTING_SLICE_VERSIONS) + 1


def _commandstats(md: Metadata) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in md.r.info("commandstats").items()}


def _settle_all(md: Metadata, vkey: str, settles, transfers: int, shards: int) -> None:
    """md.transfers.settle for each (shard, replica, node_id, digest) of one version, the
    same script with the same keys and arguments, queued in one round trip instead of two
    per settle (the seeding's versions took most of this module's time). The
    version hash settle reads first holds what create_pending wrote: transfers, shards."""
    first, *rest = settles
    md.transfers.settle(vkey, *first)  # also loads the script on this client
    with md.r.pipeline(transaction=False) as p:
        for shard, replica, node_id, digest in rest:
            md.transfers._settle.queue_loaded(
                p,
                keys=[
                    K.SETTLED.format(vkey=vkey),
                    K.READY.format(vkey=vkey),
                    K.VERSION.format(vkey=vkey),
                    K.PLACEMENT.format(digest=digest),
                    K.TRIM_MARK.format(digest=digest, node_id=node_id or ""),
                    K.PLACEMENTS_LISTED,
                ],
                args=[
                    f"{shard}:{replica}",
                    "" if node_id is None else str(shard),
                    node_id or "",
                    transfers,
                    shards,
                    "",
                    digest,
                ],
            )
        assert -1 not in p.execute()  # no copy being trimmed (settle raises for it)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Redis holding 3,000 versions, and two real nodes registered (for status's probe)."""
    root = tmp_path_factory.mktemp("listing")
    pid, port = start_redis(root / "redis")
    nodes = [start_node(root / f"node{i}") for i in range(2)]
    md = Metadata(url_for(root / "redis", port))
    ids = []
    for node in nodes:
        node_id = node.client().stat().node_id
        md.nodes.add_node(node_id, node.address)
        ids.append(node_id)
    md.nodes.add_node("f" * 32, NodeAddress("127.0.0.1", 9))  # registered, never answers
    expected = {}
    for n in range(NAMES):
        name = f"run{n:03d}/model.safetensors"
        for i in range(VERSIONS_PER_NAME):
            m = synthetic_manifest(name, i, SHARDS)
            vkey = storage_key(name, m.version_id)
            plan = [tuple(ids) for _ in m.entries]
            md.versions.create_pending(m, vkey, {"path": "/x"}, plan)
            # Most versions commit; every 10th is aborted, every 25th stays pending.
            # Shard 1 of every 7th version has one copy only.
            copies = {0: ids, 1: ids[:1] if i % 7 == 0 else ids}
            state, reason = "committed", ""
            if i % 10 == 3:
                md.transfers.settle(vkey, 0, 0, ids[0], m.entries[0].blob_sha256)
                md.versions.abort(vkey, f"lost {i}")
                state, reason, copies = "aborted", f"lost {i}", {0: ids[:1], 1: []}
            elif i % 25 == 4:
                state, copies = "pending", {0: [], 1: []}
            else:
                settles = []
                for s, holders in copies.items():
                    digest = m.entries[s].blob_sha256
                    settles += [(s, r, node_id, digest) for r, node_id in enumerate(holders)]
                    if not holders[1:]:
                        settles.append((s, 1, None, digest))
                _settle_all(md, vkey, settles, transfers=4, shards=SHARDS)
                md.versions.commit(vkey, name)
            expected[vkey] = {
                "name": name,
                "version_id": m.version_id,
                "state": state,
                "size": m.source_size,
                "shards": SHARDS,
                "tensors": SHARDS * (1 + i % 3),
                "replicas": 2,
                "min_copies": min(len(h) for h in copies.values()),
                "under_replicated": [s for s, h in copies.items() if len(h) < 2],
                "transfers": 4,
                "transfers_settled": {"committed": 4, "aborted": 1, "pending": 0}[state],
                "reason": reason,
                "created_at": m.created_at,
            }
    # The current version of each name: its newest committed one.
    for n in range(NAMES):
        name = f"run{n:03d}/model.safetensors"
        newest = [v for v, e in expected.items() if e["name"] == name and e["state"] == "committed"]
        for vkey in expected:
            if expected[vkey]["name"] == name:
                expected[vkey]["current"] = vkey == newest[-1]
    yield md, expected, ids
    for node in nodes:
        node.stop()
    os.kill(pid, signal.SIGTERM)


def _check_rows(rows: list[dict], expected: dict[str, dict]) -> None:
    assert len(rows) == len(expected)
    for row in rows:
        want = expected[row["vkey"]]
        assert {k: row[k] for k in want} == want, row["vkey"]


def test_ls_lists_3000_versions_correctly_in_a_few_round_trips(cluster):
    md, expected, _ = cluster
    md.r.config_resetstat()
    counted = CountedMetadata(md.url)
    rows = reports.checkpoints(counted)
    sent = counted.sent
    stats = _commandstats(md)
    _check_rows(rows, expected)
    # Names in order, each name's versions in the order they were requested.
    assert [r["vkey"] for r in rows] == list(expected)
    assert 0 < sent <= MAX_ROUND_TRIPS + 2 * SLICES, f"{sent} requests to Redis for one listing"
    # No manifest and no version hash read per version, no walk of the keyspace.
    assert stats.get("get", 0) <= 1  # the listing's hint (LISTING_HINT); a manifest is per version
    assert stats.get("hgetall", 0) <= 5
    assert not {"keys", "scan", "hscan", "sscan"} & set(stats)


def test_ls_of_one_name_reads_only_that_name(cluster):
    md, expected, _ = cluster
    name = "run021/model.safetensors"
    md.r.config_resetstat()
    counted = CountedMetadata(md.url)
    rows = reports.checkpoints(counted, name)
    assert 0 < counted.sent <= MAX_ROUND_TRIPS
    _check_rows(rows, {v: e for v, e in expected.items() if e["name"] == name})
    assert sum(r["current"] for r in rows) == 1
    stats = _commandstats(md)
    # Copies counted for this name's blobs only: 100 versions x 2 shards.
    assert stats.get("smembers", 0) <= VERSIONS_PER_NAME * SHARDS
    assert stats.get("get", 0) <= 1  # the listing's hint (LISTING_HINT); a manifest is per version


def test_status_over_3000_versions_names_every_under_replicated_shard(cluster):
    md, expected, ids = cluster
    md.r.config_resetstat()
    counted = CountedMetadata(md.url)
    s = reports.status(counted, None)
    assert {n["node_id"] for n in s["nodes"] if n["up"]} == set(ids)
    under = {
        (u["name"], u["version_id"], u["shard"], u["live_copies"]) for u in s["under_replicated"]
    }
    want = {
        (e["name"], e["version_id"], shard, 1)
        for e in expected.values()
        if e["state"] == "committed"
        for shard in e["under_replicated"]
    }
    assert under == want and want
    assert {p["vkey"] for p in s["pending"]} == {
        v for v, e in expected.items() if e["state"] == "pending"
    }
    stats = _commandstats(md)
    assert stats.get("get", 0) <= 1  # the listing's hint (LISTING_HINT); a manifest is per version
    assert not {"keys", "scan"} & set(stats)
    # Redis work grows only by the slices: a bounded number of requests besides them and
    # the probe's per-node updates.
    assert 0 < counted.sent <= MAX_ROUND_TRIPS + 2 * SLICES + 10 * 3


def test_versions_recorded_before_the_summaries_are_listed(cluster, tmp_path):
    """A Redis written by a release without listing summaries: the first listing fills
    them from the version hashes and manifests, once."""
    md, expected, _ = cluster
    raw = redis.Redis.from_url(md.url)  # DUMP's bytes are not text
    saved = {k: raw.dump(k) for k in (K.VERSION_ROWS, K.VERSION_STATES, K.ALL_VERSIONS)}
    md.r.delete(K.VERSION_ROWS, K.VERSION_STATES, K.ALL_VERSIONS, K.SUMMARIES_FILLED)
    try:
        _check_rows(reports.checkpoints(md), expected)
        assert md.r.exists(K.SUMMARIES_FILLED)
        assert sorted(v for v, _ in md.listing.versions_in("pending")) == sorted(
            v for v, e in expected.items() if e["state"] == "pending"
        )
    finally:
        for key, value in saved.items():
            raw.restore(key, 0, value, replace=True)
