"""The file a rank's DCP part is written to before it is stored: in memory (/dev/shm; the
staging directory where there is none), deleted by its writer once the part is committed.

A writer killed mid-save (SIGKILL, OOM) never deletes it, and a file in /dev/shm holds
its memory (a rank's whole part) until the machine reboots. So the writer holds a shared
flock on the file for as long as it lives, and each new part's writer first deletes every
part file no process holds a lock on any more (snapshot.py's journal records use the same
rule). The file gets its final name only once locked, so no sweep takes a file between
its creation and its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from coordinator import config

_SHM = Path("/dev/shm")  # noqa: S108  (memory, where the platform has it)
# A part file: .dcp-part.<uuid>.safetensors. (Before the lock, smoltorrent named them
# .dcp.<uuid>.safetensors, held by nothing: a sweep leaves those alone, as one may be an
# older smoltorrent's save in flight.)
_PREFIX = ".dcp-part."
_SUFFIX = ".safetensors"
_NEW = ".dcp-new."  # a part file before it is locked (never swept)


def directory() -> Path:
    if _SHM.is_dir() and os.access(_SHM, os.W_OK):
        return _SHM
    staging = config.home() / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    return staging


@contextlib.contextmanager
def part_file() -> Iterator[Path]:
    """A new, empty part file, locked while the block runs and deleted after it."""
    where = directory()
    sweep(where)
    name = f"{uuid.uuid4().hex}{_SUFFIX}"
    new, path = where / f"{_NEW}{name}", where / f"{_PREFIX}{name}"
    fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # the state: not for other users
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # the lock is the inode's: it follows the rename
        os.replace(new, path)
        yield path
    finally:
        new.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        os.close(fd)


def sweep(where: Path) -> list[Path]:
    """Delete the part files in `where` no live process holds (their writers died); the
    ones deleted. A worker still storing one keeps reading it (it has it open); a store
    it had not begun fails, and nothing waits for it."""
    swept = []
    for path in where.glob(f"{_PREFIX}*{_SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its writer lives
            continue
        else:
            with contextlib.suppress(OSError):
                path.unlink()
                swept.append(path)
        finally:
            os.close(fd)
    return swept
