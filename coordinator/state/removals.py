"""Removes of versions (rm, retention) and the reader marks that hold retention off.

A remove is: one script moves the version to removing (its blobs leave their reference
sets; those no version uses any more are tombstoned and listed to delete), the remove task
deletes them from the nodes (Blobs.blob_deleted), then finish_remove moves it to removed.
The scripts may have to make another version current (rm) or count the newer ones
(retention): the caller passes the hashes of the versions they may read, read just before,
and a script that meets one it was not passed changes nothing and says "stale", so the
caller reads them again and retries.
"""

from __future__ import annotations

import time

import redis

from coordinator.plan.manifest import Manifest
from coordinator.state import redis_keys as K
from coordinator.state.clock import redis_clock
from coordinator.state.scripts import load
from coordinator.state.versions import COMMITTED, digests, version_keys
from smoltorrent import defaults
from smoltorrent.errors import MetadataError

_STALE = "stale"
_CHUNK = 64  # versions read per round trip while looking for a committed one


class Removals:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._begin = load(r, "removals/begin")
        self._retire = load(r, "removals/retire")
        self._finish = load(r, "removals/finish")
        self._read = load(r, "removals/read")

    def begin_remove(self, vkey: str) -> str | None:
        """pending | committed | aborted -> removing (another version becomes current if
        this one was); the state found, None if the version is unknown. A version already
        removing is resumed by the caller; one removed is done."""
        for _ in range(defaults.SCRIPT_KEY_RETRIES):
            found = self._remove_keys(vkey)
            if found is None:
                return None
            name, keys, blob_keys, blobs = found
            others = self._successors(name, vkey) if self.r.hget(K.CURRENT, name) == vkey else []
            state = self._begin(
                keys=[*keys, *blob_keys, *(K.VERSION.format(vkey=v) for v in others)],
                args=[name, vkey, redis_clock(self.r), defaults.BLOB_TOMBSTONE_TTL_S, len(blobs)]
                + [*blobs, *others],
            )
            if state != _STALE:
                return state
        raise _churn(vkey)

    def retire(self, vkey: str, keep: int, before: int | None = None) -> str:
        """Retention's remove: committed | aborted -> removing unless the version is read
        by a gather, pinned, or kept: by default, current or among the `keep` newest
        committed versions of its name (an aborted one: unless no committed version is
        newer); with `before` (retention by prefix, `keep` unused), some request of its
        name is numbered `before` or later (its current version may go: the name goes
        whole, version by version). "retired" (the caller sends the remove), else why not:
        "current", "reading", "pinned", "kept" or the state found."""
        for _ in range(defaults.SCRIPT_KEY_RETRIES):
            found = self._remove_keys(vkey)
            if found is None:
                return "missing"
            name, keys, blob_keys, blobs = found
            if before is None:
                passed = self._newer(name, vkey)
            else:
                every = self.r.zrange(K.VERSIONS.format(name=name), 0, -1)
                passed = [v for v in every if v != vkey]
            outcome = self._retire(
                keys=[
                    *keys,
                    K.READERS.format(vkey=vkey),
                    K.PINS,
                    *blob_keys,
                    *(K.VERSION.format(vkey=v) for v in passed),
                ],
                args=[
                    name,
                    vkey,
                    redis_clock(self.r),
                    defaults.BLOB_TOMBSTONE_TTL_S,
                    keep if before is None else -1,
                    before if before is not None else 0,
                    len(blobs),
                ]
                + [*blobs, *passed],
            )
            if outcome != _STALE:
                return outcome
        raise _churn(vkey)

    def _remove_keys(self, vkey: str) -> tuple[str, list[str], list[str], list[str]] | None:
        """(name, the six leading keys, blob key pairs, digests) of a remove script."""
        name = self.r.hget(K.VERSION.format(vkey=vkey), "name")
        if name is None:
            return None
        raw = self.r.get(K.MANIFEST.format(vkey=vkey))
        blobs = digests(Manifest.from_json(raw)) if raw else []
        blob_keys = []
        for d in blobs:
            blob_keys += [K.BLOB_REFS.format(digest=d), K.BLOB_DELETING.format(digest=d)]
        keys = [
            K.VERSION.format(vkey=vkey),
            K.VERSIONS.format(name=name),
            K.CURRENT,
            K.CURRENT_SEQ,
            K.REMOVE_BLOBS.format(vkey=vkey),
            K.VERSION_STATES,
        ]
        return name, keys, blob_keys, blobs

    def _successors(self, name: str, vkey: str) -> list[str]:
        """The other versions of `name`, latest request first, up to the first committed
        one: those the remove of the current version reads to pick the next current."""
        key, out, start = K.VERSIONS.format(name=name), [], 0
        while chunk := self.r.zrevrange(key, start, start + _CHUNK - 1):
            with self.r.pipeline(transaction=False) as p:
                for v in chunk:
                    p.hget(K.VERSION.format(vkey=v), "state")
                states = p.execute()
            for v, state in zip(chunk, states, strict=True):
                if v != vkey:
                    out.append(v)
                    if state == COMMITTED:
                        return out
            start += _CHUNK
        return out

    def _newer(self, name: str, vkey: str) -> list[str]:
        """The versions of `name` requested after `vkey` (all of them if it is not listed)."""
        key = K.VERSIONS.format(name=name)
        rank = self.r.zrevrank(key, vkey)
        if rank == 0:
            return []
        return list(self.r.zrevrange(key, 0, -1 if rank is None else rank - 1))

    def finish_remove(self, vkey: str) -> bool:
        """removing -> removed, deleting the version's keys: the last step of a remove,
        once no node holds its manifest or its unshared blobs."""
        name = self.r.hget(K.VERSION.format(vkey=vkey), "name")
        if name is None:
            return False
        finished = bool(
            self._finish(
                keys=[
                    *version_keys(vkey),
                    K.VERSIONS.format(name=name),
                    K.NAMES,
                    K.REMOVE_BLOBS.format(vkey=vkey),
                    K.VERSION_ROWS,
                    K.VERSION_STATES,
                    K.ALL_VERSIONS,
                    K.MANIFEST_NODES.format(vkey=vkey),
                ],
                args=[name, vkey, time.time(), defaults.REMOVED_TOMBSTONE_TTL_S],
            )
        )
        if finished:
            # Its pin and labels name a version that is gone.
            with self.r.pipeline(transaction=False) as p:
                p.hdel(K.PINS, vkey)
                p.hdel(K.TAGS, vkey)
                p.execute()
            # A pending version removed had its spans kept. They describe these very bytes:
            # a store of them starting meanwhile loses nothing (its transfers read the
            # manifest then).
            self.r.delete(K.SPANS.format(vkey=vkey))
        return finished

    def start_reading(self, vkey: str, reader: str, ttl_s: float) -> str:
        """Set or refresh a gather's reader mark on a committed version for `ttl_s`; the
        state found (the mark is set only if it is "committed")."""
        return self._read(
            keys=[K.VERSION.format(vkey=vkey), K.READERS.format(vkey=vkey)],
            args=[reader, int(ttl_s * 1000)],
        )

    def stop_reading(self, vkey: str, reader: str) -> None:
        self.r.zrem(K.READERS.format(vkey=vkey), reader)

    def readers(self, vkey: str) -> list[str]:
        """Reader marks on a version not yet expired (by the Redis server's clock)."""
        seconds, micros = self.r.time()
        now_ms = seconds * 1000 + micros // 1000
        return list(self.r.zrangebyscore(K.READERS.format(vkey=vkey), f"({now_ms}", "+inf"))


def _churn(vkey: str) -> MetadataError:
    return MetadataError(
        f"the versions of {vkey}'s name changed under its remove {defaults.SCRIPT_KEY_RETRIES}"
        " times in a row; try again."
    )
