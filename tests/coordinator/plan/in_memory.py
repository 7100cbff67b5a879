"""A checkpoint planned and cut the way a store does, kept in memory (no node, no Redis)."""

from __future__ import annotations

import hashlib

from coordinator.plan.manifest import Manifest
from coordinator.plan.manifest_entries import shard_entries
from coordinator.plan.planner import plan_shards
from coordinator.plan.safetensors_header import read_header
from coordinator.plan.version_ids import version_id_for


def store_in_memory(path, name: str = "grpo/run1/step_100.safetensors", shards: int = 4):
    """Plan and cut `path` the way a store does; returns the manifest and its blobs."""
    header, source = read_header(path), path.read_bytes()
    plans = plan_shards(header, shards)
    blobs = [
        plan.prefix
        + source[header.data_start + plan.data_start : header.data_start + plan.data_end]
        for plan in plans
    ]
    digests = [hashlib.sha256(blob).hexdigest() for blob in blobs]
    by_name = {t.name: t for t in header.tensors}
    tensor_digests = [
        [
            hashlib.sha256(
                source[header.data_start + by_name[n].start : header.data_start + by_name[n].end]
            ).hexdigest()
            for n in plan.tensors
        ]
        for plan in plans
    ]
    manifest = Manifest(
        name=name,
        version_id=version_id_for(header.header_bytes, digests),
        source_size=header.file_size,
        header_bytes=header.header_bytes,
        replicas=2,
        shards=shard_entries(plans, digests, tensor_digests),
        created_at=1_700_000_000.25,
    )
    return manifest, blobs, plans
