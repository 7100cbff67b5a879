"""Chunks: which encoded blob holds the bytes of each raw chunk digest, so a store sends a
chunk already stored neither encoded nor at all (coordinator/dataplane/chunk_engine.py).

An entry names the encoding its blob was made with (codec.encoding_of the chunk's layout,
or codec.RAW_ENCODING): the same raw bytes in another dtype (zeros in bf16 and in fp32)
encode to another blob, and a store counts on a stored blob only if it would encode its
chunk as that blob again, which it must when a copy is to be sent from the source (a
chunk whose copies were all deleted, or sent from here without a chain).

An entry is a hint, never a reference: a chunk counts as stored only while its blob is
used by a version (its reference set), not being deleted (no tombstone) and has a
verified copy on some node. A store that uses it records the reference in the same
script that records its version (versions/create), so a remove running meanwhile keeps
the blob; if its copies were deleted just before, the transfer encodes the chunk again
from the source (chunk_engine.sendable).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

import redis

from coordinator.dataplane.codec import RAW_ENCODING
from coordinator.plan.manifest_entries import ChunkEntry
from coordinator.state import redis_keys as K
from coordinator.state.scripts import load
from smoltorrent import defaults


class Chunks:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._forget = load(r, "chunks/forget")

    def record(self, chunks: Iterable[ChunkEntry], encodings: Sequence[str] = ()) -> None:
        """Remember which blob holds each chunk (a store about to send them), made with
        encodings[chunk.index], a batch of CHUNK_RECORD_BATCH at a time: one command for
        thousands of chunks was megabytes of arguments at once in the store's worker.
        Each entry is a hint on its own, so a store that stops between two batches leaves
        nothing wrong. Without `encodings` (a rebuild, which does not plan the chunks
        again) an entry names none, and no store counts on it."""
        for batch in batched(chunks, defaults.CHUNK_RECORD_BATCH):
            mapping = {
                c.raw_sha256: f"{c.blob_sha256} {c.blob_size}"
                + (f" {encodings[c.index]}" if encodings else "")
                for c in batch
            }
            self.r.hset(K.CHUNKS, mapping=mapping)

    def stored(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], tuple[str, int]]:
        """(raw digest, encoding) -> (blob digest, blob size) for those of `keys` whose blob
        was made with that encoding (or is RAW), is in use, not being deleted and on at
        least one node: two round trips, whatever the count."""
        keys = list(dict.fromkeys(keys))
        raws = list(dict.fromkeys(raw for raw, _ in keys))
        if not raws:
            return {}
        entries = dict(zip(raws, self.r.hmget(K.CHUNKS, raws), strict=True))
        found = {}
        for raw, encoding in keys:
            if not entries[raw]:
                continue
            blob, size, *made = entries[raw].split(" ")
            if made and made[0] in (encoding, RAW_ENCODING):
                found[raw, encoding] = (blob, int(size))
        with self.r.pipeline(transaction=False) as p:
            for blob, _ in found.values():
                p.scard(K.BLOB_REFS.format(digest=blob))
                p.exists(K.BLOB_DELETING.format(digest=blob))
                p.scard(K.PLACEMENT.format(digest=blob))
            answers = p.execute()
        return {
            key: hit
            for n, (key, hit) in enumerate(found.items())
            if answers[3 * n] and not answers[3 * n + 1] and answers[3 * n + 2]
        }

    def forget(self, deleted: Iterable[tuple[str, str]]) -> int:
        """Drop the entries (raw, blob) whose blob was deleted, unless a store has named
        another blob for that raw digest since."""
        args = [x for pair in deleted for x in pair]
        return int(self._forget(keys=[K.CHUNKS], args=args)) if args else 0


def batched(items: Iterable, size: int) -> Iterable[list]:
    """`items` in lists of `size` (the last one shorter; none if there are none)."""
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch
