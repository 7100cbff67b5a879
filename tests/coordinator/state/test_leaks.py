"""The leak check (coordinator/state/leaks.py) on a real redis-server: what the manifests
imply against the references Redis holds and the blobs the nodes hold."""

from __future__ import annotations

from coordinator.state import redis_keys as K
from coordinator.state.leaks import find_leaks
from tests.coordinator.state.stores import committed_version


def test_a_leaked_reference_and_an_orphan_blob_are_reported(md, tmp_path):
    p = committed_version(md, tmp_path, "a", 1)
    blobs = {s.blob_sha256 for s in p.manifest.entries}
    inventories = {"node-a": set(blobs), "node-b": set(blobs)}
    assert find_leaks(md, inventories) == []
    # A reference no manifest implies (what versions/create left when a store joined a
    # version in another encoding), and a blob on a node no version uses.
    md.r.sadd(K.BLOB_REFS.format(digest="e" * 64), p.vkey)
    inventories["node-b"].add("f" * 64)
    leaks = find_leaks(md, inventories)
    assert len(leaks) == 2, leaks
    assert f"blob {'e' * 12} is referenced in Redis by ['{p.vkey}']" in leaks[0]
    assert f"blob {'f' * 12} on node node-b is used by no version" in leaks[1]
    # A reference a manifest implies that Redis lost is one too.
    md.r.srem(K.BLOB_REFS.format(digest=min(blobs)), p.vkey)
    assert any("but not in its references" in x for x in find_leaks(md, inventories))


def test_an_orphan_the_crosscheck_noted_is_being_collected_not_leaked(md, tmp_path):
    committed_version(md, tmp_path, "a", 1)
    md.blobs.note_orphan("f" * 64, "node-b")
    assert find_leaks(md, {"node-b": {"f" * 64}}) == []


def test_a_removed_version_holds_no_reference(md, tmp_path):
    p = committed_version(md, tmp_path, "a", 1)
    assert md.removals.begin_remove(p.vkey) == "committed"
    md.removals.finish_remove(p.vkey)
    assert find_leaks(md, {"node-a": set()}) == []
