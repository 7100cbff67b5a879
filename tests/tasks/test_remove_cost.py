"""A remove's Redis work depends on the version removed (its blobs), not on how many other
versions Redis holds: counted with INFO commandstats on a real redis-server, the remove
task run in this process (so every command counted is its own) against real nodes."""

from __future__ import annotations

import os
import signal

import pytest

import tasks.remove
from coordinator.dataplane.node_client import NodeClient
from coordinator.dataplane.store_engine import prepare_store, send_shard, write_manifest
from coordinator.local.synthetic import synthetic_manifest, write_checkpoint
from coordinator.plan.version_ids import storage_key
from coordinator.state.embedded_redis import start_redis, url_for
from coordinator.state.metadata import Metadata
from tests.nodeproc import start_node


@pytest.fixture
def world(tmp_path, monkeypatch):
    pid, port = start_redis(tmp_path / "redis")
    nodes = [start_node(tmp_path / f"node{i}") for i in range(2)]
    md = Metadata(url_for(tmp_path / "redis", port))
    for node in nodes:
        md.nodes.add_node(node.client().stat().node_id, node.address)
    monkeypatch.setattr(tasks.remove, "metadata", lambda: md)
    yield md, nodes
    for node in nodes:
        node.stop()
    os.kill(pid, signal.SIGTERM)


def _store(md: Metadata, nodes, tmp_path, name: str) -> str:
    """A real small checkpoint stored on the nodes (R=2) and committed; its vkey."""
    path = tmp_path / "victim.safetensors"
    if not path.exists():
        write_checkpoint(path, 300_000, hidden=32)
    clients = {n.client().stat().node_id: n.client() for n in nodes}
    p = prepare_store(path, name, dict.fromkeys(clients, 10**12), replicas=2, shards=2)
    md.versions.create_pending(p.manifest, p.vkey, {"host": "test"}, list(p.targets))
    for i, targets in enumerate(p.targets):
        for r, node_id in enumerate(targets):
            send_shard(p.path, p.identity, p.spans()[i], clients[node_id])
            md.transfers.settle(p.vkey, i, r, node_id, p.manifest.entries[i].blob_sha256)
    write_manifest(p.manifest, list(clients.values()))
    md.versions.commit(p.vkey, name)
    return p.vkey


def _unrelated(md: Metadata, start: int, count: int) -> None:
    """Committed versions of other names, each with a dead letter (a failed transfer)."""
    for i in range(start, start + count):
        name = f"other{i}/model.safetensors"
        m = synthetic_manifest(name, i)
        vkey = storage_key(name, m.version_id)
        md.versions.create_pending(
            m, vkey, {"host": "test"}, [("a" * 32, "b" * 32)] * len(m.entries)
        )
        md.versions.commit(vkey, name)
        md.dead_letters.add_dead_letter(f"transfer-{vkey}-0-1", {"task": "smoltorrent.transfer"})


def _commands_of_remove(md: Metadata, vkey: str) -> int:
    md.r.config_resetstat()
    result = tasks.remove.remove(vkey)
    stats = md.r.info("commandstats")
    assert result["removed"] and not result["left_behind"]
    assert md.versions.state(vkey) == "removed"
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_config", "cmdstat_info"))


def test_rm_does_the_same_redis_work_beside_1_or_2000_other_versions(world, tmp_path):
    md, nodes = world
    _commands_of_remove(md, _store(md, nodes, tmp_path, "warm-up"))  # loads the scripts
    _unrelated(md, 0, 1)
    few = _commands_of_remove(md, _store(md, nodes, tmp_path, "victim1"))
    _unrelated(md, 1, 1999)
    many = _commands_of_remove(md, _store(md, nodes, tmp_path, "victim2"))
    assert many == few
    # And it did remove: the blobs are gone from both nodes, the others' dead letters stay.
    assert all(NodeClient(n.address).list_blobs() == {} for n in nodes)
    assert md.dead_letters.dead_letter_depth() == 2000
