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
