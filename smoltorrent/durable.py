"""Durable writes: once one of these returns, a power cut cannot undo it.

One home for the fsync every layer needs (the node's blob store, a gathered file, the
trainer's journal and snapshot), because a Mac needs more than fsync(2): there it hands
the data to the drive, whose cache may still lose it, and only fcntl F_FULLFSYNC asks the
drive to write it through. Python has fcntl.F_FULLFSYNC on macOS only. Standard library
only: a storage node imports this.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

# A filesystem that does not support it (some network and external disks) fails the call;
# fsync(2) is then the most there is.
_FULLFSYNC = getattr(fcntl, "F_FULLFSYNC", None)


def sync(fd: int) -> None:
    """Make what was written to fd durable."""
    if _FULLFSYNC is not None:
        try:
            fcntl.fcntl(fd, _FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def sync_path(path: str | os.PathLike[str]) -> None:
    """Make what was written to the file at `path`, or a create, rename or unlink in the
    directory at `path`, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        sync(fd)
    finally:
        os.close(fd)


def write_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` (created or truncated) and make it durable; the caller makes
    its directory entry durable (sync_path) when that matters."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        sync(f.fileno())


def replace_file(path: Path, data: bytes, tmp_dir: Path | None = None) -> None:
    """Write `data` to `path` so readers see the old file or the new one, never a mix, and
    both the bytes and the rename survive a power cut. The temp file is made in `tmp_dir`
    (on path's filesystem; default: beside it) and removed when anything fails."""
    fd, tmp = tempfile.mkstemp(dir=tmp_dir or path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            sync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_path(path.parent)
