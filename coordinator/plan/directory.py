"""A directory checkpoint (the Hugging Face layout): several .safetensors files and the
`*.safetensors.index.json` that maps each tensor to its file, stored as one unit.

Each file becomes a checkpoint of its own, `NAME/<file>`; the unit is the set of their
versions plus the index bytes (coordinator/state/directories.py). Planning reads the
index and every file's header only, and refuses a layout the index contradicts: a
gather must hand back a directory that loads.

The unit itself is stored too, as a checkpoint with no tensors, `NAME/.directory
.safetensors`, whose header metadata holds the files' version ids and the index: its
version id is the directory's version id (content-addressed like any other), and its
manifest on the nodes lets rebuild bring the directory back after Redis is lost.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass, field

from coordinator.plan.file_names import check_file_name, check_relative_path
from coordinator.plan.file_pack import MODE_BITS, PACK_FILE, PackedFile
from coordinator.plan.safetensors_header import (
    LENGTH_PREFIX_BYTES,
    METADATA_KEY,
    CheckpointHeader,
    read_header,
)
from smoltorrent.errors import CheckpointFormatError, UnsafeNameError, UsageError

SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
RECORD_FILE = ".directory.safetensors"  # the unit's own checkpoint, NAME/RECORD_FILE
# Header metadata keys of that record.
DIRECTORY_KEY = "smoltorrent.directory"  # the directory's name
FILES_KEY = "smoltorrent.directory_files"  # JSON {file: version id}
INDEX_NAME_KEY = "smoltorrent.index_name"
INDEX_KEY = "smoltorrent.index"  # the index text, verbatim
_HEADER_ALIGNMENT = 8  # bytes, as safetensors writers pad their headers


@dataclass(frozen=True)
class DirectoryPlan:
    root: str
    files: tuple[str, ...]  # the .safetensors files, by name, sorted
    index_name: str | None  # e.g. "model.safetensors.index.json"
    index_bytes: bytes | None  # verbatim
    ignored: tuple[str, ...]  # other entries in the directory, not stored
    # With all_files: every other regular file, by path relative to root, kept byte for
    # byte in the directory's pack (coordinator/plan/file_pack.py)
    other_files: tuple[PackedFile, ...] = field(default=())


def plan_directory(path: str | os.PathLike[str], *, all_files: bool = False) -> DirectoryPlan:
    """The files of the directory at `path` and its index, checked against each other;
    with `all_files`, every other regular file in it and its folders too (symbolic links
    are not followed, and are not stored)."""
    root = os.path.abspath(os.fspath(path))
    entries = sorted(os.listdir(root))
    files = tuple(e for e in entries if e.endswith(SAFETENSORS_SUFFIX) and _is_file(root, e))
    indexes = [e for e in entries if e.endswith(INDEX_SUFFIX) and _is_file(root, e)]
    ignored = tuple(e for e in entries if e not in files and e not in indexes)
    other_files: tuple[PackedFile, ...] = ()
    if all_files:
        if PACK_FILE in files:
            raise UsageError(
                f"{os.path.join(root, PACK_FILE)}: with every file kept, that name is the"
                " pack smoltorrent keeps them in; rename the file, or store without"
                " --all-files"
            )
        other_files, ignored = _other_files(root, ignored)
    if not files:
        raise UsageError(
            f"{root} is a directory with no .safetensors files in it: store a directory of"
            " safetensors files (a Hugging Face checkpoint), or one file"
        )
    if len(indexes) > 1:
        raise CheckpointFormatError(
            f"{root} holds {len(indexes)} index files ({', '.join(indexes)}); a directory"
            " checkpoint has one. Move the others out and store it again."
        )
    index_name = indexes[0] if indexes else None
    index_bytes = None
    if index_name is not None:
        with open(os.path.join(root, index_name), "rb") as f:
            index_bytes = f.read()
        _check_index(root, index_name, index_bytes, files)
    else:
        for file in files:
            read_header(os.path.join(root, file))
    return DirectoryPlan(root, files, index_name, index_bytes, ignored, other_files)


def _is_file(root: str, entry: str) -> bool:
    return os.path.isfile(os.path.join(root, entry))


def _other_files(
    root: str, entries: tuple[str, ...]
) -> tuple[tuple[PackedFile, ...], tuple[str, ...]]:
    """(the regular files among `entries` and under the folders among them, by relative
    path; what is neither, by relative path: links, sockets, devices). lstat throughout:
    a link is never followed, so nothing outside `root` is read, or walked into twice."""
    kept: list[PackedFile] = []
    skipped: list[str] = []
    todo = list(entries)
    while todo:
        rel = todo.pop()
        st = os.lstat(os.path.join(root, rel))
        if stat.S_ISDIR(st.st_mode):
            todo += [f"{rel}/{e}" for e in os.listdir(os.path.join(root, rel))]
        elif stat.S_ISREG(st.st_mode):
            try:
                check_relative_path(rel, root)
            except UnsafeNameError:
                raise UsageError(
                    f"{os.path.join(root, rel)!r}: smoltorrent keeps no file whose name has a"
                    " backslash or a control character; rename it and store again"
                ) from None
            kept.append(PackedFile(rel, st.st_size, st.st_mode & MODE_BITS))
        else:
            skipped.append(rel)
    return tuple(sorted(kept, key=lambda f: f.path)), tuple(sorted(skipped))


def _check_index(root: str, index_name: str, raw: bytes, files: tuple[str, ...]) -> None:
    where = os.path.join(root, index_name)

    def fail(problem: str) -> None:
        raise CheckpointFormatError(
            f"{where}: {problem}. Fix the index (or the files) so they agree, then store again."
        )

    try:
        index = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        fail(f"not JSON ({exc})")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        fail("no weight_map of tensor names to file names")
    if unknown := sorted(set(weight_map.values()) - set(files)):
        fail(f"it maps tensors to {', '.join(unknown)}, which the directory does not hold")
    for file in files:
        names = {t.name for t in read_header(os.path.join(root, file)).tensors}
        mapped = {t for t, f in weight_map.items() if f == file}
        if names != mapped:
            stray = sorted(names ^ mapped)[:3]
            fail(f"{file} and the index disagree on its tensors ({', '.join(stray)}, ...)")


def path_in(directory: str, file: str, name: str) -> str:
    """Where a gather writes `file` of directory checkpoint `name`: inside `directory`."""
    return os.path.join(directory, check_file_name(file, name))


@dataclass(frozen=True)
class DirectoryRecord:
    name: str
    files: dict[str, str]  # file -> version id
    index_name: str | None
    index_bytes: bytes | None

    def __post_init__(self) -> None:  # made by a store, or parsed from a node's copy
        for file in self.files:
            check_file_name(file, self.name)
        if self.index_name is not None:
            check_file_name(self.index_name, self.name)


def record_bytes(record: DirectoryRecord) -> bytes:
    """The unit as a .safetensors file with no tensors: its header metadata says it all.
    Canonical (sorted keys): the same directory always gives the same bytes."""
    if record.index_bytes is not None:
        try:
            index_text = record.index_bytes.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointFormatError(
                f"the index {record.index_name} of {record.name} is not UTF-8 text"
            ) from None
    metadata = {
        DIRECTORY_KEY: record.name,
        FILES_KEY: json.dumps(record.files, sort_keys=True, separators=(",", ":")),
    }
    if record.index_name is not None:
        metadata |= {INDEX_NAME_KEY: record.index_name, INDEX_KEY: index_text}
    raw = json.dumps({METADATA_KEY: metadata}, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-(LENGTH_PREFIX_BYTES + len(raw)) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


def record_of(header: CheckpointHeader) -> DirectoryRecord | None:
    """The directory a record checkpoint's header describes; None for any other header."""
    meta = header.metadata or {}
    if DIRECTORY_KEY not in meta or header.tensors:
        return None
    try:
        files = json.loads(meta[FILES_KEY])
    except (KeyError, json.JSONDecodeError):
        return None
    if not isinstance(files, dict) or not all(
        isinstance(f, str) and isinstance(v, str) for f, v in files.items()
    ):
        return None
    index = meta.get(INDEX_KEY)
    return DirectoryRecord(
        name=meta[DIRECTORY_KEY],
        files=files,
        index_name=meta.get(INDEX_NAME_KEY),
        index_bytes=None if index is None else index.encode("utf-8"),
    )
