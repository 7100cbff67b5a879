"""Versions recorded straight into the metadata from real checkpoint files, as a store
request would record them (no node involved)."""

from __future__ import annotations

from coordinator.dataplane.store_engine import PreparedStore, prepare_store
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.metadata import Metadata

FREE = {"node-a": 10**12, "node-b": 10**12}


def prepared(tmp_path, name: str, seed: int) -> PreparedStore:
    path = tmp_path / f"{name.replace('/', '_')}-{seed}.safetensors"
    write_checkpoint(path, 200_000 + seed, hidden=32)
    return prepare_store(path, name, FREE, replicas=2, shards=2)


def pending(md: Metadata, p: PreparedStore, task_id: str = "t1") -> bool:
    """Record the version a new store request asks for; True if it was created."""
    found = md.versions.create_pending(p.manifest, p.vkey, {"request_id": task_id}, list(p.targets))
    return found == "created"


def settle_all(md: Metadata, p: PreparedStore) -> None:
    for shard, nodes in enumerate(p.targets):
        for replica, node in enumerate(nodes):
            md.transfers.settle(p.vkey, shard, replica, node, p.manifest.entries[shard].blob_sha256)


def committed_version(md: Metadata, tmp_path, name: str, seed: int) -> PreparedStore:
    p = prepared(tmp_path, name, seed)
    pending(md, p)
    md.versions.commit(p.vkey, name)
    return p
