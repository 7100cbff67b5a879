"""A save as the training step sees it: one copy of the tensors' bytes into shared
memory, and a journal record of the save on local disk, fsync'd, before save returns.

The snapshot is a file under /dev/shm (defaults.SNAPSHOT_SHM_DIR) laid out tensor after
tensor: the only copy the step waits for, and a consistent one (an in-place update
after save returns never reaches it). The writer process (smoltorrent/snapshot_writer.py)
turns it into the staged .safetensors file with safetensors' own serializer, straight
from the shared pages (no second copy in the trainer), fsyncs it, and stores it.

The journal, STAGING/journal/SEQ.ID.json, is what makes a save durable: it names the
save (name, replicas, header metadata, tensor layout, snapshot, staged file). A
process responsible for a save holds a shared flock on its record (the trainer until
the save ends, its writer while it works on it), so a record nobody holds a lock on is
an orphan: its trainer and writer both died, and the next writer adopts it.

MLX arrays (no writable view of shared memory from MLX) and dtypes safetensors' plain
serializer does not take are written by the framework's own writer here, in the
trainer, as before; the writer then takes the staged file as it is.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smoltorrent import defaults, durable
from smoltorrent.errors import StateDictError
from smoltorrent.keypaths import Flat
from smoltorrent.tensors import write_file

log = logging.getLogger(__name__)

# The dtypes safetensors' serializer takes by name (safetensors.TensorSpec), as torch and
# numpy (ml_dtypes) name them.
SPEC_DTYPES = frozenset(
    {
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "complex64",
    }
)
_STEM_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_STEM_MAX_CHARS = 80  # characters of the name kept in a staged file's name; the rest is an id


@dataclass
class Job:
    """A save handed to the writer: its journal record, held locked by this process."""

    id: str
    record: str
    staged: str
    lock: int | None  # fd of the record holding the shared flock; None once released
    buffer: Buffer | None = None  # the snapshot's mapping, until the writer has staged it

    def release(self) -> None:
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None


@dataclass
class Buffer:
    """A snapshot file under shared memory, mapped (its pages in place) in this process."""

    path: Path
    size: int
    map: Any  # mmap.mmap, None for a size of 0

    def close(self, unlink: bool) -> None:
        if self.map is not None:
            self.map.close()
        if unlink:
            self.path.unlink(missing_ok=True)


class Pool:
    """Snapshot buffers the writer has staged, kept mapped for the next save: a fresh
    shared-memory file costs a page fault per 4 KiB page, about as much again as the copy
    itself, and a reused one none. At most SNAPSHOT_POOL_BUFFERS are kept; the writer
    deletes the ones kept when this process ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: list[Buffer] = []

    def get(self, size: int, path: Path) -> Buffer | None:
        """A kept buffer of at least `size` bytes, renamed to `path`; None if none fits."""
        with self.lock:
            fits = [b for b in self.free if b.size >= size and b.path.parent == path.parent]
            if not fits:
                return None
            buffer = min(fits, key=lambda b: b.size)
            self.free.remove(buffer)
        os.replace(buffer.path, path)
        buffer.path = path
        return buffer

    def put(self, buffer: Buffer) -> None:
        with self.lock:
            self.free.append(buffer)
            surplus = self.free[: -defaults.SNAPSHOT_POOL_BUFFERS or None]
            del self.free[: len(surplus)]
        for old in surplus:
            old.close(unlink=True)


def journal_dir(staging: Path) -> Path:
    return staging / "journal"


def take(
    flat: Flat,
    header: dict[str, str] | None,
    name: str,
    replicas: int,
    step: dict[str, Any] | None,
    staging: Path,
    pool: Pool,
    *,
    bwlimit: int | None = None,
) -> Job:
    """Snapshot the tensors and journal the save; returns once both are in place."""
    job_id = uuid.uuid4().hex
    stem = f"{_STEM_CHARS.sub('_', name)[-_STEM_MAX_CHARS:]}.{job_id[:12]}"
    staged = staging / f"{stem}.safetensors"
    layout = _layout(flat)
    snapshot = buffer = None
    if layout is None:
        _write_staged(flat, header, staged)
    else:
        buffer = _snapshot(flat, layout, staging, job_id, pool)
        snapshot = str(buffer.path)
    record = {
        "id": job_id,
        "name": name,
        "replicas": replicas,
        "header": header,
        "layout": layout,
        "snapshot": snapshot,
        "staged": str(staged),
        "step": step,
        "bwlimit": bwlimit,
        "created": time.time(),
    }
    try:
        job = _journal(record, staging)
    except BaseException:
        if buffer is not None:
            buffer.close(unlink=True)
        staged.unlink(missing_ok=True)
        raise
    job.buffer = buffer
    return job


def _layout(flat: Flat) -> list[list[Any]] | None:
    """[name, dtype, shape, offset, bytes] per tensor in the snapshot, or None when the
    framework's own writer must write the file."""
    if flat.framework not in ("torch", "numpy"):
        return None
    layout = []
    offset = 0
    for name, tensor in flat.tensors.items():
        if flat.framework == "torch":
            if tensor.is_sparse or tensor.device.type == "meta":
                return None  # the framework's writer says what it makes of these
            dtype, nbytes = str(tensor.dtype).split(".")[-1], tensor.numel() * tensor.element_size()
        else:
            dtype, nbytes = tensor.dtype.name, tensor.nbytes
        if dtype not in SPEC_DTYPES:
            return None
        layout.append([name, dtype, list(tensor.shape), offset, nbytes])
        offset += -(-nbytes // defaults.SNAPSHOT_ALIGN_BYTES) * defaults.SNAPSHOT_ALIGN_BYTES
    return layout


def _snapshot(
    flat: Flat, layout: list[list[Any]], staging: Path, job_id: str, pool: Pool
) -> Buffer:
    """Copy every tensor's bytes into a shared-memory file: a kept one, or a new one."""
    size = max((off + n for _, _, _, off, n in layout), default=0)
    directory = _snapshot_dir(staging, size)
    path = directory / f"{job_id}.snapshot"
    buffer = pool.get(size, path) if size else None
    try:
        if buffer is None:
            buffer = _new_buffer(path, size)
        if size:
            _copy_into(buffer.map, flat, layout)
    except BaseException as exc:
        if buffer is not None:
            buffer.close(unlink=True)
        if isinstance(exc, OSError):
            raise StateDictError(
                f"cannot snapshot the state ({size} bytes) into {directory}: {exc}; free "
                "space there or pass staging_dir= on a disk with room"
            ) from exc
        raise
    return buffer


def _new_buffer(path: Path, size: int) -> Buffer:
    import mmap

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if not size:
            return Buffer(path, 0, None)
        # Reserve the pages now: a full /dev/shm fails here, not with a SIGBUS mid-copy.
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        mapped.madvise(mmap.MADV_HUGEPAGE)  # fewer faults where shared memory may use them
    return Buffer(path, size, mapped)


def _snapshot_dir(staging: Path, size: int) -> Path:
    shm = Path(defaults.SNAPSHOT_SHM_DIR)
    if shm.is_dir() and os.access(shm, os.W_OK):
        fs = os.statvfs(shm)
        if fs.f_bavail * fs.f_frsize > size:
            directory = shm / f"smoltorrent-{os.getuid()}"
            if _private_dir(directory):
                return directory
    directory = staging / ".snapshots"
    directory.mkdir(exist_ok=True)
    return directory


def _private_dir(directory: Path) -> bool:
    """Whether `directory` in the shared /dev/shm is ours alone, made so if we just made it.
    Another local user can make the name first (or a link by that name): such a one is
    never used, or they could swap a snapshot under the writer, or make the save raise
    into the training step; the save falls back to the staging directory."""
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    found = os.lstat(directory)
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
        log.warning(
            "%s is not a directory of this user's (a link, or another user's): snapshots go "
            "to the staging directory instead; remove it to keep them in memory",
            directory,
        )
        return False
    if stat.S_IMODE(found.st_mode) != 0o700:
        os.chmod(directory, 0o700)  # ours, but others could have written into it
    return True


def _copy_into(mm: Any, flat: Flat, layout: list[list[Any]]) -> None:
    if flat.framework == "torch":
        import torch

        base = torch.frombuffer(mm, dtype=torch.uint8)
        with torch.no_grad():
            for (_, _, shape, off, n), tensor in zip(layout, flat.tensors.values(), strict=True):
                if n:
                    base[off : off + n].view(tensor.dtype).view(shape).copy_(tensor)
    else:
        import numpy as np

        base = np.frombuffer(mm, dtype=np.uint8)
        for (_, _, shape, off, n), array in zip(layout, flat.tensors.values(), strict=True):
            if n:
                base[off : off + n].view(array.dtype).reshape(shape)[...] = array
    del base  # no view may outlive the map, or it cannot be closed


def _write_staged(flat: Flat, header: dict[str, str] | None, staged: Path) -> None:
    """The framework's own writer, to a temp name then renamed: never a half-written file."""
    # MLX appends .safetensors to any other suffix, so the temp name ends with it too.
    tmp = staged.with_name(f".{staged.stem}.partial.safetensors")
    try:
        write_file(flat.tensors, str(tmp), flat.framework, header)
        os.replace(tmp, staged)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _journal(record: dict[str, Any], staging: Path) -> Job:
    """Write the record locked, fsync it and its directory entry: durable from here on."""
    journal = journal_dir(staging)
    journal.mkdir(exist_ok=True)
    final = journal / f"{time.time_ns():020d}.{record['id']}.json"
    tmp = journal / f".{final.name}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # the lock follows the file through the rename
        os.write(fd, json.dumps(record).encode())
        durable.sync(fd)
        os.replace(tmp, final)
        durable.sync_path(journal)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return Job(record["id"], str(final), record["staged"], fd)


def has_orphans(staging: Path) -> bool:
    """Whether the journal holds a save no live process holds (its trainer and writer died)."""
    journal = journal_dir(staging)
    if not journal.is_dir():
        return False
    for path in journal.glob("*.json"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            continue
        finally:
            os.close(fd)
    return False
