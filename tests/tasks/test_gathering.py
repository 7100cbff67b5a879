"""The gather itself (tasks/gathering.py), in the test's own process as in a reader's: its
Redis work does not grow with the number of chunks it reads."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from bench.scale_metadata import CountedMetadata
from coordinator.local.synthetic import write_checkpoint
from tasks.gathering import run_gather


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_gathers_redis_requests_do_not_grow_with_its_chunks(make_cluster, tmp_path, monkeypatch):
    """Each chunk's holders were one SMEMBERS round trip (282 for a 1 GB checkpoint):
    they are read in one pipeline, so a gather of 3x the chunks sends as many requests.
    Likewise the cluster key: it was read (environment, then a file check) for every
    holder of every chunk, 564 reads and ~30 ms before a 1 GB gather's first byte; now
    once per node a gather reads from."""
    from coordinator import config

    c = make_cluster(4, chunks=True)
    for name, value in c.env().items():
        monkeypatch.setenv(name, value)
    key_reads = [0]
    read_key = config.cluster_key

    def counted() -> bytes | None:
        key_reads[0] += 1
        return read_key()

    monkeypatch.setattr(config, "cluster_key", counted)
    chunks, sent, keys = {}, {}, {}
    for name, size in (("small", 20_000_000), ("large", 60_000_000)):
        src = tmp_path / name
        write_checkpoint(src, size, hidden=512)
        past = time.time() - 60  # settled: the store does not wait for the file to settle
        os.utime(src, (past, past))
        c.cli("store", str(src), "--name", name)
        md = CountedMetadata(c.redis_url)
        vkey = md.versions.current(name)
        chunks[name] = len(md.versions.manifest(vkey).chunks)
        md.sent = 0
        key_reads[0] = 0
        out = tmp_path / f"{name}.out"
        report = run_gather(md, vkey, str(out), None, f"test-reader-{name}")
        sent[name] = md.sent
        keys[name] = key_reads[0]
        assert sha(out) == sha(src) and report["bad_copies"] == []
    assert chunks["large"] >= 3 * chunks["small"] >= 15, chunks
    # The first gather also loads its scripts into Redis: the second sends no more.
    assert sent["large"] <= sent["small"], (chunks, sent)
    assert keys["large"] <= 4 and keys["small"] <= 4, keys


def test_a_gathers_clients_are_one_per_node_whatever_its_chunks(make_cluster, tmp_path):
    """Each chunk's replicas were clients and a list of its own (twice: paced, then over
    the kept connections), a gather's memory growing with the chunk count: one client per
    node and one list per read order now, each chunk's replicas still in its read order."""
    from coordinator.dataplane.bandwidth import WireMeter
    from coordinator.dataplane.node_client import KeptConnections
    from coordinator.dataplane.replicas import keeping
    from coordinator.plan.read_order import read_order
    from coordinator.state.metadata import Metadata
    from tasks.gathering import _sources

    c = make_cluster(4, chunks=True)
    src = tmp_path / "model"
    write_checkpoint(src, 20_000_000, hidden=512)
    past = time.time() - 60
    os.utime(src, (past, past))
    c.cli("store", str(src), "--name", "model")
    md = Metadata(c.redis_url)
    manifest = md.versions.manifest(md.versions.current("model"))
    nodes = md.nodes.nodes()
    sources = _sources(md, manifest, nodes, WireMeter.limited(None))
    holders = [list(p) for p in md.blobs.placement_of([e.blob_sha256 for e in manifest.entries])]
    orders = read_order(holders, [e.blob_size for e in manifest.entries], md.nodes.alive(nodes))
    assert [[str(c.address) for c in s] for s in sources] == [
        [str(nodes[n].address) for n in order] for order in orders
    ]
    assert len(sources) == len(manifest.chunks) >= 5
    assert len({id(c) for s in sources for c in s}) == len({n for o in orders for n in o}) <= 4
    assert len({id(s) for s in sources}) == len({tuple(o) for o in orders})
    kept = keeping(sources, KeptConnections())
    assert [[str(c.address) for c in s] for s in kept] == [
        [str(c.address) for c in s] for s in sources
    ]
    assert len({id(c) for s in kept for c in s}) == len({id(c) for s in sources for c in s})
    assert len({id(s) for s in kept}) == len({id(s) for s in sources})
