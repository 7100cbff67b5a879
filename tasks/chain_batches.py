"""The entries of a chain task, and how a chunked version's chunks are grouped into them.

A chain task delivers one blob per entry: replicas `replicas` of manifest entry `shard`
to the nodes `node_ids`, in chain order (and settles the later entries `same` with its
blob). Its first entry is the task's own arguments (shard, replicas, node_ids, digest,
same), as in every chain message ever queued; a batch adds the further entries as
`more`, a list of the same fields. A task per chunk cost more in Celery dispatch and
Redis reads than its chunk took to move (a 1 GB store, 282 chunks: 57 ms a task for
3.5 MB), so chunks whose chains go to the same nodes in the same order share a task
(batches). Whole shards (schema 2: a few, big) keep a task each.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from smoltorrent import defaults


class ChainEntry(NamedTuple):
    shard: int
    replicas: tuple[int, ...]
    node_ids: tuple[str, ...]
    digest: str
    same: tuple[int, ...] = ()

    @classmethod
    def of(cls, fields: Mapping) -> ChainEntry:
        return cls(
            int(fields["shard"]),
            tuple(int(r) for r in fields["replicas"]),
            tuple(fields["node_ids"]),
            fields["digest"],
            tuple(int(i) for i in fields.get("same") or ()),
        )

    def fields(self) -> dict:
        """The entry as a message carries it (JSON: lists, `same` only when it has some)."""
        out = {
            "shard": self.shard,
            "replicas": list(self.replicas),
            "node_ids": list(self.node_ids),
            "digest": self.digest,
        }
        return out | ({"same": list(self.same)} if self.same else {})


def chain_entries(kwargs: Mapping) -> list[ChainEntry]:
    """Every entry a chain task's keyword arguments carry, its own first."""
    return [ChainEntry.of(kwargs), *(ChainEntry.of(e) for e in kwargs.get("more") or ())]


def chain_message(entries: Sequence[ChainEntry]) -> dict:
    """The chain task's keyword arguments for `entries` (without vkey and name)."""
    first, more = entries[0], entries[1:]
    return first.fields() | ({"more": [e.fields() for e in more]} if more else {})


def chain_task_id(vkey: str, entries: Sequence[ChainEntry]) -> str:
    """Deterministic: a re-send of the same set is the same task (and dead letter). One
    entry keeps the id it always had; a batch adds its size and a digest of its entries."""
    first = entries[0]
    task_id = f"chain-{vkey}-{first.shard}-{'-'.join(str(r) for r in first.replicas)}"
    if len(entries) == 1:
        return task_id
    text = ";".join(f"{e.shard}:{','.join(map(str, e.replicas))}" for e in entries)
    return f"{task_id}-b{len(entries)}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def batches(
    entries: Sequence[ChainEntry], sizes: Mapping[int, int], chunked: bool
) -> list[list[ChainEntry]]:
    """`entries` (in manifest order) grouped into chain tasks, in the order of their first
    entries: one each for whole shards; for chunks, those with the same chain (replicas
    and nodes, in order) together, in batches of about equal size, none above
    CHAIN_BATCH_BYTES of blobs or CHAIN_BATCH_ENTRIES, and small enough that there are
    CHAIN_BATCH_MIN_TASKS tasks when there are as many chunks."""
    if not chunked:
        return [[e] for e in entries]
    most = max(
        1, min(defaults.CHAIN_BATCH_ENTRIES, _ceil(len(entries), defaults.CHAIN_BATCH_MIN_TASKS))
    )
    chains: dict[tuple, list[ChainEntry]] = {}
    for entry in entries:
        chains.setdefault((entry.replicas, entry.node_ids), []).append(entry)
    out: list[list[ChainEntry]] = []
    for group in chains.values():
        blob_bytes = sum(sizes[e.shard] for e in group)
        count = max(_ceil(len(group), most), _ceil(blob_bytes, defaults.CHAIN_BATCH_BYTES))
        per = _ceil(len(group), count)  # the same number in each, rather than a small last
        batch, filled = [], 0
        for entry in group:
            size = sizes[entry.shard]
            if batch and (len(batch) >= per or filled + size > defaults.CHAIN_BATCH_BYTES):
                out.append(batch)
                batch, filled = [], 0
            batch.append(entry)
            filled += size
        out.append(batch)
    return sorted(out, key=lambda batch: batch[0].shard)


def _ceil(n: int, d: int) -> int:
    return -(-n // d)
