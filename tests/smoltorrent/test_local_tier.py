"""The local tier: a machine's last saves, read before the cluster once checked against
the manifest. A hit needs no node (every node frozen), a save evicted by the count is
read from the cluster, and a copy with a flipped bit is deleted and read from the
cluster, byte for byte. Real Redis, nodes, worker and writer process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from coordinator.plan.version_ids import storage_key
from smoltorrent import local_tier
from tests.smoltorrent.conftest import ApiSession

SAVE = """
import json, torch, smoltorrent
ids = [smoltorrent.save({"w": torch.full((64, 64), float(v)), "step": v}, "tier/run").version_id
       for v in (1, 2, 3)]
print(json.dumps(ids))
"""

# Loads by (version or None, source); prints each value or the error's class.
LOAD = """
import json, smoltorrent
from smoltorrent.errors import NotFoundError
out = []
for version, source in CALLS:
    try:
        state = smoltorrent.load("tier/run", version=version, source=source)
        out.append([state["step"], float(state["w"][0, 0]), float(state["w"].sum())])
    except NotFoundError as exc:
        out.append(type(exc).__name__)
print(json.dumps(out))
"""


def test_a_hit_needs_no_node_a_miss_and_a_bad_copy_read_the_cluster(make_cluster):
    c = make_cluster(2, SMOLTORRENT_LOCAL_KEEP="2")
    # One API process for the saves and every load (one import of torch), as a trainer.
    with ApiSession(c, timeout=120) as api:
        check(c, api)


def check(c, api: ApiSession) -> None:
    def load(calls) -> list:
        return api.run(LOAD.replace("CALLS", repr(calls)))

    v1, v2, v3 = api.run(SAVE)
    tier = local_tier.tier_dir(c.root / "staging")
    kept = {p.name for p in tier.iterdir()}
    assert kept == {f"{storage_key('tier/run', v)}.safetensors" for v in (v2, v3)}  # v1 evicted
    whole = [3, 3.0, 3.0 * 64 * 64]

    # Hit: every node frozen, the newest save still loads, from this machine's copy.
    for node in c.node_procs:
        node.send_signal(signal.SIGSTOP)
    try:
        assert load([(None, "auto"), (v2[:12], "local")]) == [whole, [2, 2.0, 2.0 * 4096]]
    finally:
        for node in c.node_procs:
            node.send_signal(signal.SIGCONT)

    # Miss: v1 was evicted by the count; it comes from the cluster, and not from the tier.
    assert load([(v1[:12], "auto"), (v1[:12], "local")]) == [[1, 1.0, 4096.0], "NotFoundError"]

    # A bit flipped in v3's kept copy: the copy is deleted, and v3 read from the cluster.
    bad = tier / f"{storage_key('tier/run', v3)}.safetensors"
    with open(bad, "r+b") as f:
        f.seek(os.path.getsize(bad) - 4)  # inside w's bytes
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    # The auto load reads the cluster and deletes the bad copy, so the local-only load
    # after it finds nothing.
    assert load([(None, "auto"), (None, "local")]) == [whole, "NotFoundError"]
    assert not bad.exists()


def _file(path: Path, size: int, mtime_ns: int) -> Path:
    path.write_bytes(b"\0" * size)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def test_eviction_keeps_the_newest_within_count_and_bytes(tmp_path: Path):
    tier = tmp_path / "local"
    tier.mkdir()
    for i, size in enumerate([10, 10, 30, 10]):  # f0 oldest, f3 newest
        _file(tier / f"f{i}.safetensors", size, (i + 1) * 10**9)
    # Three by count; by bytes f3 and f2 fit in 45, f1 does not: it goes, and f0 with it.
    removed = local_tier.evict(tier, count=3, max_bytes=45)
    assert sorted(p.name for p in removed) == ["f0.safetensors", "f1.safetensors"]
    assert local_tier.evict(tier, count=1, max_bytes=45) == [tier / "f2.safetensors"]

    # A save over the whole budget, or with the tier off, is not kept (the caller deletes it).
    staged = _file(tmp_path / "big.safetensors", 100, 0)
    assert not local_tier.keep(tmp_path, "n", "a" * 64, staged, 2, 45)
    assert not local_tier.keep(tmp_path, "n", "a" * 64, staged, 0, 1000)
    assert local_tier.keep(tmp_path, "n", "a" * 64, staged, 2, 1000)
    assert {p.name for p in tier.iterdir()} == {
        "f3.safetensors",
        f"{storage_key('n', 'a' * 64)}.safetensors",
    }
