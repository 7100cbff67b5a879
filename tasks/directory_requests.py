"""Store and gather a directory checkpoint (the Hugging Face layout) as one unit, through
the same durable requests as single files (tasks/requests.py).

Store: a sequence number is taken, then every file is submitted at once (so the worker
stores them in parallel), each a version of `NAME/<file>`; once all are committed, the
directory's record (their version ids and the index, coordinator/plan/directory.py) is
stored as a checkpoint of its own, and its version is recorded and made current in one
Redis step, unless a store of the directory accepted later is current already. A crash
before that leaves the files stored and the directory at its previous version: store
it again (no byte moves twice). Gather: every file into a temp directory beside the
destination, all at once, then the index, fsync, and one rename onto the destination,
so a reader never sees half a directory (coordinator/dataplane/staged_output.py, which
also removes the temp directory of a gather that died).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator import config
from coordinator.dataplane.staged_output import staged_directory
from coordinator.plan.directory import (
    RECORD_FILE,
    DirectoryPlan,
    DirectoryRecord,
    path_in,
    plan_directory,
    record_bytes,
)
from coordinator.plan.manifest import check_name
from coordinator.state.directories import Directories, DirectoryVersion, Member
from smoltorrent import defaults, durable
from smoltorrent.errors import SmoltorrentError
from tasks.requests import (
    connected_metadata,
    submit_gather,
    submit_store,
    wait_gather,
    wait_store,
)


@dataclass(frozen=True)
class StoredDirectory:
    version: DirectoryVersion
    new_files: list[str]  # files whose bytes were not on the cluster before
    plan: DirectoryPlan


def member_name(name: str, file: str) -> str:
    return f"{name}/{file}"


def store_directory(
    path: str,
    name: str | None = None,
    replicas: int = defaults.DEFAULT_REPLICAS,
    on_file: Callable[[str], None] | None = None,
) -> StoredDirectory:
    """Store the directory at `path` as one version of `name` (default: its base name)."""
    plan = plan_directory(path)
    name = name or os.path.basename(plan.root.rstrip(os.sep))
    for file in plan.files:  # every name first: a bad one queues none of the files
        check_name(member_name(name, file))
    # Its place among the directory's stores: whichever finishes first, the one accepted
    # last is current.
    seq = Directories(connected_metadata().r).accept()
    requests = [
        (file, submit_store(os.path.join(plan.root, file), member_name(name, file), replicas))
        for file in plan.files
    ]
    md = connected_metadata()
    members: dict[str, Member] = {}
    new_files = []
    for file, request in requests:
        out = wait_store(request)
        v = md.versions.version(out["vkey"])
        members[file] = Member(request.name, out["vkey"], v["version_id"], int(v["size"]))
        if out["new"]:
            new_files.append(file)
        if on_file:
            on_file(file)
    record = DirectoryRecord(
        name, {f: m.version_id for f, m in members.items()}, plan.index_name, plan.index_bytes
    )
    version = DirectoryVersion(
        name=name,
        version_id=_store_record(record, replicas),
        files=members,
        index_name=plan.index_name,
        index=plan.index_bytes,
        created_at=time.time(),
    )
    Directories(md.r).commit(version, seq)
    return StoredDirectory(version, new_files, plan)


def _store_record(record: DirectoryRecord, replicas: int) -> str:
    """Store the directory's record as NAME/.directory.safetensors; its version id."""
    staging = config.home() / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".directory.", suffix=".safetensors", dir=staging)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(record_bytes(record))
        request = submit_store(path, member_name(record.name, RECORD_FILE), replicas, complete=True)
        out = wait_store(request)
        return connected_metadata().versions.version(out["vkey"])["version_id"]
    finally:
        os.unlink(path)


def directory_checkpoints(name: str) -> list[str]:
    """The checkpoint names making up every version of directory `name`: its files and
    its record."""
    members = Directories(connected_metadata().r).member_names(name)
    return sorted(members | {member_name(name, RECORD_FILE)})


def forget_directory(name: str) -> None:
    Directories(connected_metadata().r).forget(name)


def is_directory(name: str) -> bool:
    return Directories(connected_metadata().r).is_directory(name)


def directory_version(name: str, version: str | None = None) -> DirectoryVersion:
    return Directories(connected_metadata().r).get(name, version)


def gather_directory(name: str, out: str, version: str | None = None) -> DirectoryVersion:
    """Rebuild a directory checkpoint at `out` (which must not exist, or be empty)."""
    found = directory_version(name, version)
    out = os.path.abspath(out)
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise SmoltorrentError(
            f"{out} exists and is not an empty directory; a directory checkpoint is gathered"
            " into a new (or empty) directory. Choose another output or move it away."
        )
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise SmoltorrentError(f"{parent}: no such directory for the output")
    with staged_directory(out) as tmp:
        requests = [
            submit_gather(m.name, path_in(tmp, file, name), m.version_id)
            for file, m in sorted(found.files.items())
        ]
        for request in requests:
            wait_gather(request)
        if found.index_name is not None:
            durable.write_file(path_in(tmp, found.index_name, name), found.index or b"")
    return found
