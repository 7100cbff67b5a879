"""A directory's other files into their pack, and back out of it, byte for byte
(the format: coordinator/plan/file_pack.py).

Bytes move file to file in the kernel (copy_file_range, a reflink where the file system
can) or through one fixed buffer: a pack of a 20 GB optimizer.pt never becomes a Python
object (invariant 6). Store side, a file whose size changed since it was planned is
refused: the pack would hold another file's bytes under its name. Gather side, every
path is checked before the first byte is written, each file is created new
(O_EXCL, O_NOFOLLOW) under the temp directory the gather owns, and fsynced.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from coordinator.plan.file_names import check_relative_path
from coordinator.plan.file_pack import PackedFile, is_pack, pack_header, packed_files
from coordinator.plan.safetensors_header import read_header
from smoltorrent import defaults, durable
from smoltorrent.errors import SmoltorrentError, UnsafeNameError

# copy_file_range says no for these (another file system, an old kernel, a special file):
# the copy goes through a buffer instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}


def write_pack(root: str, files: Sequence[PackedFile], out: str, directory: str) -> None:
    """Write the pack of `files` (relative to `root`) at `out`, a new file."""
    header, placed = pack_header(files, directory)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, header)  # a few kB: written whole
        for f in placed:
            src = os.open(os.path.join(root, f.path), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                if os.fstat(src).st_size != f.size:
                    raise SmoltorrentError(
                        f"{os.path.join(root, f.path)} changed while its directory was being"
                        " stored; store the directory again once it is written"
                    )
                _copy(src, 0, fd, f.size)
            finally:
                os.close(src)
    finally:
        os.close(fd)


def unpack(pack: str, out_dir: str, directory: str, taken: Sequence[str]) -> bool:
    """Write the files of the pack at `pack` into `out_dir` and delete the pack; False,
    leaving it as it is, when `pack` is no pack (a file of that name stored as one).
    `taken`: the directory's other members' names, which no packed file may replace."""
    header = read_header(pack)
    if not is_pack(header):
        return False
    files = packed_files(header, directory)  # every path checked before any is written
    for f in files:
        if f.path.split("/")[0] in taken:
            raise UnsafeNameError(
                f"{f.path!r} in directory checkpoint {directory}'s pack would replace its"
                " member file; its file list was not written by smoltorrent"
            )
    src = os.open(pack, os.O_RDONLY)
    made: set[str] = set()
    try:
        for f in files:
            parent = os.path.dirname(check_relative_path(f.path, directory))
            _make_folders(out_dir, parent, made)
            target = os.path.join(out_dir, f.path)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                _copy(src, header.data_start + f.offset, fd, f.size)
                os.fchmod(fd, f.mode)
                durable.sync(fd)
            finally:
                os.close(fd)
    finally:
        os.close(src)
    os.unlink(pack)
    for folder in sorted(made, key=len, reverse=True):
        durable.sync_path(os.path.join(out_dir, folder))
    return True


def _make_folders(out_dir: str, parent: str, made: set[str]) -> None:
    """Each folder of `parent` made under `out_dir`, one component at a time, never
    through a link (a folder made here is made by this gather: mkdir fails on anything
    already there that is not one of them)."""
    rel = ""
    for part in parent.split("/") if parent else ():
        rel = f"{rel}/{part}" if rel else part
        if rel not in made:
            os.mkdir(os.path.join(out_dir, rel), 0o755)
            made.add(rel)


def _copy(src: int, offset: int, dst: int, size: int) -> None:
    """`size` bytes of `src` from `offset` appended to `dst`; the kernel's copy when it
    can, else a fixed buffer. A source shorter than `size` fails: it changed."""
    done = 0
    kernel = hasattr(os, "copy_file_range")
    while done < size:
        want = min(size - done, defaults.SENDFILE_MAX_BYTES)
        moved = None
        if kernel:
            try:
                moved = os.copy_file_range(src, dst, want, offset + done)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                kernel = False
        if moved is None:
            data = os.pread(src, min(want, defaults.IO_CHUNK_BYTES), offset + done)
            moved = len(data)
            view = memoryview(data)
            while view:
                view = view[os.write(dst, view) :]
        if moved == 0:
            raise SmoltorrentError(
                f"a file ended {size - done} bytes early while it was copied; it changed"
            )
        done += moved
