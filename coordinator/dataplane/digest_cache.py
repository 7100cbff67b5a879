"""Plan-time digests remembered by the source file's identity.

Storing an unchanged file again (a watcher restart's file_sync, a rollback that
re-saves earlier bytes, the same `save` twice) would otherwise read and hash every
byte again before finding that nothing has to move. An entry is keyed by the file's
device, inode, size, mtime and ctime, and by the shard plan (or the chunk plan: a chunked
store keeps each chunk's raw digest, which finds the chunk stored without reading it):
ctime cannot be set from user space, so a rewrite that restores the old mtime (rsync -t, `touch -r`)
still misses. The nodes verify every blob against its digest whatever the cache
says, so an entry can never put wrong bytes on a node.

One small JSON file per entry under a directory of this host (the worker runs where
the sources are); the oldest entries go beyond DIGEST_CACHE_ENTRIES.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from coordinator.plan.chunks import ChunkPlan
from coordinator.plan.planner import ShardPlan
from smoltorrent import defaults

# Per shard: blob digest, tensor digests; per chunk: raw digest, no tensors.
Hashed = list[tuple[str, tuple[str, ...]]]


class DigestCache:
    def __init__(
        self, directory: str | os.PathLike[str], max_entries: int = defaults.DIGEST_CACHE_ENTRIES
    ) -> None:
        self.directory = Path(directory)
        self.max_entries = max_entries

    @staticmethod
    def key(st: os.stat_result, plans: Sequence[ShardPlan]) -> str:
        identity = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        shards = [
            [
                p.index,
                p.data_start,
                p.data_end,
                list(p.tensors),
                hashlib.sha256(p.prefix).hexdigest(),
            ]
            for p in plans
        ]
        return hashlib.sha256(json.dumps([identity, shards]).encode()).hexdigest()

    @staticmethod
    def chunks_key(st: os.stat_result, plans: Sequence[ChunkPlan]) -> str:
        """The key of a chunked store's raw chunk digests (each kept with no tensors)."""
        identity = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        chunks = [
            [p.index, p.data_start, p.data_end, [list(run) for run in p.layout]] for p in plans
        ]
        return hashlib.sha256(json.dumps([identity, "chunks", chunks]).encode()).hexdigest()

    def get(self, key: str) -> Hashed | None:
        try:
            entry = json.loads((self.directory / f"{key}.json").read_bytes())
            return [(str(blob), tuple(map(str, tensors))) for blob, tensors in entry]
        except (OSError, ValueError, TypeError):
            return None  # missing, or damaged: hash again

    def put(self, key: str, hashed: Hashed) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps([[blob, list(tensors)] for blob, tensors in hashed]))
            os.replace(tmp, self.directory / f"{key}.json")
            self._trim()
        except OSError:
            pass  # a cache that cannot be written only costs the next store a re-hash

    def _trim(self) -> None:
        entries = list(self.directory.glob("*.json"))
        if len(entries) <= self.max_entries:
            return
        entries.sort(key=lambda p: p.stat().st_mtime_ns)
        for old in entries[: len(entries) - self.max_entries]:
            old.unlink(missing_ok=True)
