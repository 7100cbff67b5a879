"""An output file that appears whole or not at all.

A gather writes into a temp file beside the destination, reserved to its final size
first (a full disk fails before a byte moves), and renames it onto the destination
only once everything in it is verified, with the file and its directory fsynced; on
any failure the temp file is removed and an existing destination is untouched.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from smoltorrent.errors import GatherError


def fsync_dir(path: str) -> None:
    """Make a rename or create in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise GatherError(
                    f"not enough free space in {directory} for {what} ({size} bytes); free"
                    " some space or write it elsewhere. Nothing was written."
                ) from None
        yield fd
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, out_path)
        fsync_dir(directory)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
