"""Names from Redis, a node's manifest or a pack that a gather joins to its output
directory: each must stay inside it. A directory checkpoint's file and index names are
one file name each; the paths of its other files (coordinator/plan/file_pack.py) are
relative paths of such names."""

from __future__ import annotations

from smoltorrent.errors import UnsafeNameError


def check_file_name(file: object, directory: str) -> str:
    """`file` if it is one file name, else UnsafeNameError. A directory's file and index
    names come from Redis, or from a node's copy of its record in a rebuild, and a gather
    joins them to its output: '/home/u/.bashrc' or '../x' would be written there."""
    if (
        not isinstance(file, str)
        or file in ("", ".", "..")
        or "/" in file
        or "\\" in file
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in file)
    ):
        raise UnsafeNameError(
            f"{str(file)[:80]!r} in directory checkpoint {directory} is not one file name;"
            " its record was not written by smoltorrent. Store the directory again."
        )
    return file


def check_relative_path(path: object, directory: str) -> str:
    """`path` if it is a relative path of one or more file names joined by '/', else
    UnsafeNameError: '/etc/cron.d/x', '../x', 'a/../../x' or 'a//b' would put a file
    outside (or beside) the directory a gather writes."""
    if not isinstance(path, str) or not path or path.startswith("/"):
        raise UnsafeNameError(
            f"{str(path)[:80]!r} in directory checkpoint {directory} is not a relative path;"
            " its file list was not written by smoltorrent. Store the directory again."
        )
    for part in path.split("/"):
        check_file_name(part, directory)
    return path
