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
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from coordinator import config
from coordinator.dataplane.pack_io import unpack, write_pack
from coordinator.dataplane.staged_output import staged_directory
from coordinator.plan.directory import (
    RECORD_FILE,
    DirectoryPlan,
    DirectoryRecord,
    path_in,
    plan_directory,
    record_bytes,
)
from coordinator.plan.file_pack import PACK_FILE
from coordinator.plan.version_ids import check_name
from coordinator.state.directories import Directories, DirectoryVersion, Member
from coordinator.state.versions import REMOVED
from smoltorrent import defaults, durable
from smoltorrent.errors import SmoltorrentError
from tasks.requests import (
    StoreRequest,
    connected_metadata,
    submit_gather,
    submit_remove,
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
    *,
    all_files: bool = False,
    give_up_unserved: bool = False,
) -> StoredDirectory:
    """Store the directory at `path` as one version of `name` (default: its base name).
    all_files: every other file in it (and its folders) too, byte for byte, in one more
    member, NAME/.files.safetensors (coordinator/plan/file_pack.py); else only the
    .safetensors files and the index are stored. give_up_unserved: as wait_store takes
    it (a training step's store)."""
    plan = plan_directory(path, all_files=all_files)
    name = name or os.path.basename(plan.root.rstrip(os.sep))
    members = [*plan.files, *([PACK_FILE] if plan.other_files else [])]
    for file in members:  # every name first: a bad one queues none of the files
        check_name(member_name(name, file))
    # Its place among the directory's stores: whichever finishes first, the one accepted
    # last is current.
    seq = Directories(connected_metadata().r).accept()
    with _packed(plan, name) as pack:
        requests = [
            (file, submit_store(os.path.join(plan.root, file), member_name(name, file), replicas))
            for file in plan.files
        ]
        if pack is not None:
            request = submit_store(pack, member_name(name, PACK_FILE), replicas, complete=True)
            requests.append((PACK_FILE, request))
        return _commit(plan, name, replicas, seq, requests, on_file, give_up_unserved)


@contextmanager
def _packed(plan: DirectoryPlan, name: str) -> Iterator[str | None]:
    """The path of the pack of the plan's other files, written in the staging directory
    and deleted once its store has ended; None when there are none."""
    if not plan.other_files:
        yield None
        return
    staging = config.home() / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    path = str(staging / f".files.{uuid.uuid4().hex}.safetensors")
    try:
        write_pack(plan.root, plan.other_files, path, name)
        yield path
    finally:
        with suppress(FileNotFoundError):
            os.unlink(path)


def _commit(
    plan: DirectoryPlan,
    name: str,
    replicas: int,
    seq: int,
    requests: list[tuple[str, StoreRequest]],
    on_file: Callable[[str], None] | None,
    give_up_unserved: bool = False,
) -> StoredDirectory:
    """Wait for every member's store, then store the directory's record and make its
    version current (unless a store accepted later is)."""
    md = connected_metadata()
    members: dict[str, Member] = {}
    new_files = []
    for file, request in requests:
        out = wait_store(request, give_up_unserved=give_up_unserved)
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
        version_id=_store_record(record, replicas, give_up_unserved),
        files=members,
        index_name=plan.index_name,
        index=plan.index_bytes,
        created_at=time.time(),
    )
    Directories(md.r).commit(version, seq)
    return StoredDirectory(version, new_files, plan)


def _store_record(record: DirectoryRecord, replicas: int, give_up_unserved: bool) -> str:
    """Store the directory's record as NAME/.directory.safetensors; its version id."""
    staging = config.home() / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".directory.", suffix=".safetensors", dir=staging)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(record_bytes(record))
        request = submit_store(path, member_name(record.name, RECORD_FILE), replicas, complete=True)
        out = wait_store(request, give_up_unserved=give_up_unserved)
        return connected_metadata().versions.version(out["vkey"])["version_id"]
    finally:
        os.unlink(path)


def directory_checkpoints(name: str) -> list[str]:
    """The checkpoint names making up every version of directory `name`: its files and
    its record."""
    members = Directories(connected_metadata().r).member_names(name)
    return sorted(members | {member_name(name, RECORD_FILE)})


def remove_directory(name: str) -> bool:
    """Remove directory `name` whole, every version of its files and its records, and
    forget it, without waiting for its blobs to go (retention from a training step):
    each version is marked removing at once, so no gather takes it and the reconcile
    sweep finishes a remove that dies. False, and nothing removed, when one of its
    versions is pinned (as `rm` refuses it)."""
    md = connected_metadata()
    vkeys = [v for n in directory_checkpoints(name) for v in md.versions.versions(n)]
    if any(pin for pin, _ in md.versions.labels(vkeys).values()):
        return False
    for vkey in vkeys:
        if md.versions.state(vkey) not in (None, REMOVED):
            submit_remove(vkey)
    forget_directory(name)  # last: a crash before leaves it listed, removed on the next pass
    return True


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
        if PACK_FILE in found.files:  # the directory's other files, stored with all_files
            taken = [f for f in [*found.files, found.index_name] if f and f != PACK_FILE]
            unpack(path_in(tmp, PACK_FILE, name), tmp, name, taken)
    return found
