"""An output file, or directory, that appears whole or not at all.

A gather writes into a temp file beside the destination, reserved to its final size
first (a full disk fails before a byte moves), and renames it onto the destination
only once everything in it is verified, with the file and its directory fsynced; on
any failure the temp file is removed and an existing destination is untouched. A
directory checkpoint's gather does the same with a temp directory its files go into.

A gather that dies where no handler runs (SIGKILL, the OOM killer, a power cut) cannot
remove its temp file or directory, and that is as big as the checkpoint. So each gather
holds an flock on it until it is renamed or removed (the kernel drops it with the
process), and the next gather into the same destination removes those no live gather
holds. A live one is never touched: two runs of one request whose lease lapsed each
write their own.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
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
_SUFFIX = ".partial"


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
    prefix = f".{os.path.basename(out_path)}."
    _remove_abandoned(directory, prefix)
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=_SUFFIX, dir=directory)
    try:
        # Before the reservation: a file with bytes reserved is always held while its
        # gather lives (blocking, as a cleaner may hold it for an instant: see below).
        fcntl.flock(fd, fcntl.LOCK_EX)
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
        # Still held through the rename: closed before it, the file would look abandoned.
        os.replace(tmp, out_path)
        durable.sync_path(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


@contextmanager
def staged_directory(out_path: str) -> Iterator[str]:
    """The path of a temp directory beside out_path, renamed onto out_path (absent, or an
    empty directory) when the block ends without an error, removed with all in it when it
    raises. The block fsyncs what it writes there; this fsyncs the directories."""
    parent = os.path.dirname(out_path)
    prefix = f".{os.path.basename(out_path)}."
    _remove_abandoned(parent, prefix, directories=True)
    tmp = tempfile.mkdtemp(prefix=prefix, suffix=_SUFFIX, dir=parent)
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Before anything is put in it (blocking, as for a file): a directory not empty is
        # always held while its gather lives.
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
        durable.sync(fd)
        # Still held through the rename, as a file is.
        os.replace(tmp, out_path)
        durable.sync_path(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def _remove_abandoned(directory: str, prefix: str, *, directories: bool = False) -> None:
    """Remove the temp files (with `directories`, the temp directories) of gathers into
    the destination `prefix` names that died before they could: those no process holds.
    An empty one is left: it may be a live gather's that has not taken its lock yet (a
    dead one's costs no space)."""
    with os.scandir(directory) as entries:
        names = [
            e.name
            for e in entries
            if e.name.startswith(prefix)
            and e.name.endswith(_SUFFIX)
            # mkstemp's random part has no dot: a name with one is another destination's
            and "." not in e.name[len(prefix) : -len(_SUFFIX)]
            and (e.is_dir if directories else e.is_file)(follow_symlinks=False)
        ]
    flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if directories else 0)
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, flags)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Locked by us, and not empty: its gather is gone. The name is checked to be
            # this one still: a gather that ended renamed or removed it under its lock.
            held = os.fstat(fd)
            if os.stat(path, follow_symlinks=False).st_ino != held.st_ino:
                continue
            if directories and os.listdir(fd):
                # Errors ignored: a worker still gathering one of a dead directory gather's
                # files may add one as it goes; the next gather here removes the rest.
                shutil.rmtree(path, ignore_errors=True)
            elif not directories and held.st_size:
                os.unlink(path)
        except OSError:  # held by a live gather (BlockingIOError), or gone meanwhile
            pass
        finally:
            os.close(fd)
