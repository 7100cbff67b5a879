"""An output file that appears whole or not at all.

A gather writes into a temp file beside the destination, reserved to its final size
first (a full disk fails before a byte moves), and renames it onto the destination
only once everything in it is verified, with the file and its directory fsynced; on
any failure the temp file is removed and an existing destination is untouched.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from smoltorrent import durable
from smoltorrent.errors import GatherError

# macOS's fcntl(F_PREALLOCATE) and its struct fstore (sys/fcntl.h): Python's fcntl module
# names none of these. The flags ask for every byte (F_ALLOCATEALL) from the physical end
# of the file (F_PEOFPOSMODE); the struct is fst_flags (u32), fst_posmode (int), then
# fst_offset, fst_length and fst_bytesalloc (off_t).
_F_PREALLOCATE = 42
_F_ALLOCATEALL = 0x4
_F_PEOFPOSMODE = 3
_FSTORE = struct.Struct("=Iiqqq")
# A file system that cannot reserve space says so with these; the file is then sized
# without a reservation and a full disk shows on the first write that does not fit.
_NO_RESERVATION = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


def reserve(fd: int, size: int) -> None:
    """Make the empty file fd `size` bytes long, its blocks reserved where the platform can:
    posix_fallocate (Linux), fcntl F_PREALLOCATE (macOS, whose Python has no
    posix_fallocate), else a plain truncate. OSError(ENOSPC) when the space is not there."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in _NO_RESERVATION:
                raise
    elif sys.platform == "darwin":
        store = _FSTORE.pack(_F_ALLOCATEALL, _F_PEOFPOSMODE, 0, size, 0)
        try:
            fcntl.fcntl(fd, _F_PREALLOCATE, store)
        except OSError as exc:
            if exc.errno not in _NO_RESERVATION:
                raise
    os.ftruncate(fd, size)  # F_PREALLOCATE reserves blocks but leaves the length at 0


@contextmanager
def staged_output(out_path: str, size: int, what: str) -> Iterator[int]:
    """The fd of a temp file beside out_path with `size` bytes reserved; renamed onto
    out_path when the block ends without an error, removed when it raises. `what`
    names the content in the error a full disk gives."""
    directory = os.path.dirname(out_path)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{os.path.basename(out_path)}.", suffix=".partial", dir=directory
    )
    try:
        if size:
            try:
                reserve(fd, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise GatherError(
                    f"not enough free space in {directory} for {what} ({size} bytes); free"
                    " some space or write it elsewhere. Nothing was written."
                ) from None
        yield fd
        durable.sync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, out_path)
        durable.sync_path(directory)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
