"""Directory checkpoints in Redis: which version of each file, and the index, make up
each version of a directory, and which version is current.

A directory version is recorded only once every one of its files is committed, and it
becomes current in the same step, so a reader sees the new directory whole or the old
one. Current is the latest accepted store of the directory, not the last to finish: a
store takes its sequence number from the one request counter before it submits any file,
and a version becomes current only over one of a lower number. Each file stays an
ordinary checkpoint, `NAME/<file>`, whose manifest the nodes keep; the index bytes live
here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis

from coordinator.plan.directory import check_file_name
from coordinator.plan.version_ids import check_version_key
from coordinator.state import redis_keys as K
from coordinator.state.scripts import load
from smoltorrent.errors import NotFoundError

_VERSION = "version:"


@dataclass(frozen=True)
class Member:
    name: str  # the file's own checkpoint name, NAME/<file>
    vkey: str
    version_id: str
    size: int

    def __post_init__(self) -> None:
        check_version_key(self.vkey)


@dataclass(frozen=True)
class DirectoryVersion:
    name: str
    version_id: str
    files: dict[str, Member]  # by file name
    index_name: str | None
    index: bytes | None
    created_at: float

    def __post_init__(self) -> None:
        """Recorded by a store or a rebuild, or read back from Redis: a gather joins every
        file name and the index name to its output, so each is one file name."""
        for file in self.files:
            check_file_name(file, self.name)
        if self.index_name is not None:
            check_file_name(self.index_name, self.name)


class Directories:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._commit = load(r, "directories/commit")

    def accept(self) -> int:
        """A sequence number for a directory store, from the one request counter: taken
        before its files are submitted, it orders it among every other request."""
        return int(self.r.incr(K.SEQ))

    def commit(self, version: DirectoryVersion, seq: int) -> bool:
        """Record a version whose every file is committed; it becomes current unless a
        store accepted after its own (a higher `seq`) is current already. Whether it did."""
        record = {
            "files": {f: vars(m) for f, m in version.files.items()},
            "index_name": version.index_name,
            "index": None if version.index is None else version.index.decode("utf-8"),
            "created_at": version.created_at or time.time(),
        }
        field, raw = _VERSION + version.version_id, json.dumps(record, sort_keys=True)
        key = K.DIRECTORY.format(name=version.name)
        return bool(self._commit(keys=[key], args=[field, raw, version.version_id, seq]))

    def is_directory(self, name: str) -> bool:
        return bool(self.r.exists(K.DIRECTORY.format(name=name)))

    def get(self, name: str, version: str | None = None) -> DirectoryVersion:
        """The current version of directory `name`, or the one whose id starts `version`."""
        raw = self.r.hgetall(K.DIRECTORY.format(name=name))
        if not raw:
            raise NotFoundError(f"no directory checkpoint named {name}; see `smoltorrent ls`.")
        ids = [f[len(_VERSION) :] for f in raw if f.startswith(_VERSION)]
        matches = [raw["current"]] if version is None else [i for i in ids if i.startswith(version)]
        if len(matches) != 1:
            raise NotFoundError(
                f"directory {name} has {'no' if not matches else 'several'} versions matching "
                f"'{version}'; `smoltorrent ls` lists them."
            )
        record = json.loads(raw[_VERSION + matches[0]])
        return DirectoryVersion(
            name=name,
            version_id=matches[0],
            files={f: Member(**m) for f, m in record["files"].items()},
            index_name=record["index_name"],
            index=None if record["index"] is None else record["index"].encode("utf-8"),
            created_at=float(record["created_at"]),
        )

    def member_names(self, name: str) -> set[str]:
        """Every file checkpoint any version of directory `name` uses, and its record's."""
        names = set()
        for field, raw in self.r.hgetall(K.DIRECTORY.format(name=name)).items():
            if field.startswith(_VERSION):
                names |= {m["name"] for m in json.loads(raw)["files"].values()}
        return names

    def forget(self, name: str) -> None:
        """Drop the directory's record (its files' versions are removed first)."""
        self.r.delete(K.DIRECTORY.format(name=name))
