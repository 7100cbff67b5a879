"""Blobs: which versions use each blob (reference sets), the tombstone of a blob being
deleted, each blob's placement (the nodes holding a verified copy), and what the
crosscheck and readers find wrong with copies (orphans, bad copies).

Every change to a placement drops the blob's field in PLACEMENTS_LISTED in the same step
(the listing's copy of it), so a field present always equals its set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence

import redis

from coordinator.state import redis_keys as K
from coordinator.state.scripts import load
from smoltorrent import defaults


class Blobs:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._deleted = load(r, "blobs/deleted")
        self._claim_delete = load(r, "blobs/claim_delete")
        self._claim_orphan = load(r, "blobs/claim_orphan")
        self._record_copy = load(r, "blobs/record_copy")
        self._orphan_deleted = load(r, "blobs/orphan_deleted")

    # --- references and tombstones -------------------------------------------------

    def blob_refs(self, digest: str) -> set[str]:
        return set(self.r.smembers(K.BLOB_REFS.format(digest=digest)))

    def referenced(self, digests: list[str]) -> dict[str, bool]:
        """digest -> whether any version (not removing or removed) uses it, one round trip
        per PLACEMENT_BATCH_DIGESTS (the crosscheck asks of every blob the nodes hold)."""
        counts: list[int] = []
        for start in range(0, len(digests), defaults.PLACEMENT_BATCH_DIGESTS):
            with self.r.pipeline(transaction=False) as p:
                for d in digests[start : start + defaults.PLACEMENT_BATCH_DIGESTS]:
                    p.scard(K.BLOB_REFS.format(digest=d))
                counts += p.execute()
        return {d: n > 0 for d, n in zip(digests, counts, strict=True)}

    def blob_deleting(self, digest: str) -> bool:
        """Whether a remove is deleting this blob from the nodes right now."""
        return bool(self.r.exists(K.BLOB_DELETING.format(digest=digest)))

    def any_deleting(self, digests: Iterable[str]) -> bool:
        """Whether a remove is deleting any of these blobs right now (one EXISTS)."""
        keys = [K.BLOB_DELETING.format(digest=d) for d in digests]
        return bool(keys) and bool(self.r.exists(*keys))

    def blobs_to_delete(self, vkey: str) -> set[str]:
        """Blobs a removing version left unreferenced, not yet deleted from the nodes."""
        return set(self.r.smembers(K.REMOVE_BLOBS.format(vkey=vkey)))

    def claim_delete(self, vkey: str, digest: str) -> bool:
        """Whether the remove of `vkey` may delete `digest` from the nodes now: no version
        uses it (its tombstone is then renewed); one that does takes it off the remove's
        list. Asked again before every delete: a remove can stay open for hours."""
        keys = [
            K.BLOB_REFS.format(digest=digest),
            K.BLOB_DELETING.format(digest=digest),
            K.REMOVE_BLOBS.format(vkey=vkey),
        ]
        return bool(
            self._claim_delete(keys=keys, args=[digest, vkey, defaults.BLOB_TOMBSTONE_TTL_S])
        )

    def blob_deleted(self, vkey: str, digest: str, nodes: Iterable[str]) -> None:
        """The remove of `vkey` deleted `digest` from every node in `nodes` that held it."""
        self._deleted(
            keys=[
                K.PLACEMENT.format(digest=digest),
                K.BLOB_REFS.format(digest=digest),
                K.BLOB_DELETING.format(digest=digest),
                K.REMOVE_BLOBS.format(vkey=vkey),
                K.PLACEMENTS_LISTED,
            ],
            args=[digest, *nodes],
        )

    # --- placement -----------------------------------------------------------------

    def placement(self, digest: str) -> set[str]:
        return set(self.r.smembers(K.PLACEMENT.format(digest=digest)))

    def placement_of(self, digests: Sequence[str]) -> list[frozenset[str]]:
        """Each blob's placement, in order, one round trip per PLACEMENT_BATCH_DIGESTS (a
        gather's thousands of chunks: a pipeline of them all held a command and a reply
        each at once). Blobs on the same nodes share one set."""
        shared: dict[frozenset[str], frozenset[str]] = {}
        out: list[frozenset[str]] = []
        for start in range(0, len(digests), defaults.PLACEMENT_BATCH_DIGESTS):
            with self.r.pipeline(transaction=False) as p:
                for digest in digests[start : start + defaults.PLACEMENT_BATCH_DIGESTS]:
                    p.smembers(K.PLACEMENT.format(digest=digest))
                for members in p.execute():
                    placement = frozenset(members)
                    out.append(shared.setdefault(placement, placement))
        return out

    def add_placement(self, digest: str, node_id: str) -> None:
        with self.r.pipeline() as p:  # MULTI: the listed copy goes with the change
            p.sadd(K.PLACEMENT.format(digest=digest), node_id)
            p.hdel(K.PLACEMENTS_LISTED, digest)
            p.execute()

    def add_placements(self, digests: Iterable[str], node_id: str) -> None:
        """add_placement of every digest on one node, PLACEMENT_BATCH_DIGESTS a round trip
        (a rebuild's 100,000 blobs: one MULTI a blob took most of its time), each batch one
        MULTI: short, and the listed copies go with their changes."""
        digests = list(digests)
        for start in range(0, len(digests), defaults.PLACEMENT_BATCH_DIGESTS):
            batch = digests[start : start + defaults.PLACEMENT_BATCH_DIGESTS]
            with self.r.pipeline() as p:
                for digest in batch:
                    p.sadd(K.PLACEMENT.format(digest=digest), node_id)
                p.hdel(K.PLACEMENTS_LISTED, *batch)
                p.execute()

    def remove_placement(self, digest: str, node_id: str) -> None:
        with self.r.pipeline() as p:
            p.srem(K.PLACEMENT.format(digest=digest), node_id)
            p.hdel(K.PLACEMENTS_LISTED, digest)
            p.execute()

    def placements(self) -> dict[str, set[str]]:
        """Every blob's placement: digest -> node ids holding a verified copy. The keys come
        from a SCAN of the keyspace, their sets one round trip per PLACEMENT_BATCH_DIGESTS
        (the crosscheck's 100,000 blobs were one pipeline, a command and a reply each held
        at once)."""
        head, tail = K.PLACEMENT.split("{digest}")
        out: dict[str, set[str]] = {}
        keys: list[str] = []

        def read() -> None:
            with self.r.pipeline(transaction=False) as p:
                for k in keys:
                    p.smembers(k)
                members = p.execute()
            out.update(
                (k[len(head) : len(k) - len(tail)], set(m))
                for k, m in zip(keys, members, strict=True)
            )
            keys.clear()

        for key in self.r.scan_iter(match=K.PLACEMENT.format(digest="*"), count=1000):
            keys.append(key)
            if len(keys) == defaults.PLACEMENT_BATCH_DIGESTS:
                read()
        read()
        return out

    def record_copy(self, digest: str, node_id: str) -> bool:
        """Add a copy a node holds to the placement if a version uses the blob; True if it
        was not listed before."""
        keys = [
            K.PLACEMENT.format(digest=digest),
            K.BLOB_REFS.format(digest=digest),
            K.PLACEMENTS_LISTED,
        ]
        return bool(self._record_copy(keys=keys, args=[node_id, digest]))

    # --- orphans (the crosscheck) --------------------------------------------------

    def note_orphan(self, digest: str, node_id: str) -> float:
        """Record (once) that `node_id` holds `digest` with no version using it; seconds
        since it was first found so, by the Redis clock."""
        now = self.r.time()[0]
        field = f"{digest}:{node_id}"
        self.r.hsetnx(K.ORPHANS, field, now)
        return now - float(self.r.hget(K.ORPHANS, field) or now)

    def orphan_marks(self) -> set[str]:
        return set(self.r.hkeys(K.ORPHANS))

    def forget_orphans(self, fields: Iterable[str]) -> None:
        fields = list(fields)
        if fields:
            self.r.hdel(K.ORPHANS, *fields)

    def claim_orphan(self, digest: str, owner: str) -> bool:
        """Tombstone an unreferenced blob before deleting it from nodes; False if a version
        uses it or a remove is deleting it."""
        keys = [K.BLOB_REFS.format(digest=digest), K.BLOB_DELETING.format(digest=digest)]
        return bool(self._claim_orphan(keys=keys, args=[owner, defaults.BLOB_TOMBSTONE_TTL_S]))

    def orphan_deleted(self, digest: str, owner: str, nodes: Iterable[str]) -> None:
        """The crosscheck `owner` deleted orphan `digest` from `nodes` (maybe none): drop
        their placement and orphan marks, and its tombstone."""
        self._orphan_deleted(
            keys=[
                K.PLACEMENT.format(digest=digest),
                K.BLOB_REFS.format(digest=digest),
                K.BLOB_DELETING.format(digest=digest),
                K.ORPHANS,
                K.PLACEMENTS_LISTED,
            ],
            args=[owner, digest, *nodes],
        )

    # --- bad copies (readers) ------------------------------------------------------

    def record_bad_copy(self, digest: str, node_id: str, reason: str) -> None:
        """Note a copy that served wrong bytes, for the integrity sweep to repair."""
        self.r.hset(
            K.BAD_COPIES, f"{digest}:{node_id}", json.dumps({"reason": reason, "at": time.time()})
        )

    def reported_bad_copies(self) -> list[tuple[str, str]]:
        """(digest, node id) of every copy a reader found corrupt, not yet checked."""
        return [tuple(f.split(":", 1)) for f in self.r.hkeys(K.BAD_COPIES)]

    def forget_bad_copy(self, digest: str, node_id: str) -> None:
        self.r.hdel(K.BAD_COPIES, f"{digest}:{node_id}")
