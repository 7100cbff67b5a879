"""A manifest's entries as a store makes them, and the ChunkTable's own checks."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.plan.manifest_entries import ChunkEntry, ChunkTable, shard_entries


def test_shard_entries_need_one_digest_per_plan(stored):
    _, _, _, plans = stored
    with pytest.raises(ValueError, match="4 shard plans but 3 blob digests"):
        shard_entries(plans, ["0" * 64] * 3)


def test_a_chunk_table_takes_entries_only_at_their_own_position_with_real_digests():
    entry = ChunkEntry(0, 0, 1, "a" * 64, 2, "b" * 64)
    assert ChunkTable.of([entry])[0] == entry
    with pytest.raises(ValueError, match="chunk 1 is listed at position 0"):
        ChunkTable.of([dataclasses.replace(entry, index=1)])
    with pytest.raises(ValueError, match="64 lowercase hex"):
        ChunkTable.of([dataclasses.replace(entry, raw_sha256="A" * 64)])
