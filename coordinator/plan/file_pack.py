"""A directory checkpoint's other files (not .safetensors), kept byte for byte: the
format of their pack, `NAME/.files.safetensors`.

A Hugging Face Trainer's `checkpoint-N` holds, beside model.safetensors, the files it
needs to resume: trainer_state.json, optimizer.pt, scheduler.pt, rng_state.pth,
training_args.bin (pickles, torch.save's zips). A directory stored with every file
(`smoltorrent store DIR --all-files`) packs them into one more member of the directory:
a .safetensors file whose tensors are `U8` vectors of each file's exact bytes, named by
its path relative to the directory, its header metadata marking it a pack and holding
each file's permission bits. It is a checkpoint like any other: chunked, deduplicated,
verified, replicated, rebuilt from the nodes' manifests; the nodes need nothing new, and
nothing in it is ever parsed but its header: smoltorrent never unpickles a file.

A pack's paths come back from Redis and the nodes and a gather joins them to its
output, so each is checked when made and when read (`check_relative_path`): relative,
each component one file name (no '..', no '.', no empty one), and none both a file and
another's folder. This module is pure: coordinator/dataplane/pack_io.py moves the bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.plan.file_names import check_relative_path
from coordinator.plan.safetensors_header import (
    LENGTH_PREFIX_BYTES,
    METADATA_KEY,
    CheckpointHeader,
)
from smoltorrent.errors import UnsafeNameError

PACK_FILE = ".files.safetensors"  # the pack's file name among a directory's members
FILES_KEY = "smoltorrent.files"  # header metadata: JSON {relative path: permission bits}
_DTYPE = "U8"
_HEADER_ALIGNMENT = 8  # bytes, as safetensors writers pad their headers
# Permission bits a restored file may get: no set-uid, set-gid or sticky bit from a pack.
MODE_BITS = 0o777


@dataclass(frozen=True)
class PackedFile:
    path: str  # relative to the directory, '/'-separated
    size: int  # bytes
    mode: int  # permission bits (MODE_BITS)
    offset: int = 0  # in the pack's data section


def check_paths(paths: Iterable[str], directory: str) -> None:
    """Every path checked, none twice, and none a folder of another: 'a' and 'a/b' cannot
    both be files."""
    seen: set[str] = set()
    for path in paths:
        check_relative_path(path, directory)
        if path in seen:
            raise UnsafeNameError(f"{path!r} is listed twice in directory checkpoint {directory}")
        seen.add(path)
    for path in seen:
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                raise UnsafeNameError(
                    f"{'/'.join(parts[:i])!r} is both a file and a folder in directory"
                    f" checkpoint {directory}; its file list was not written by smoltorrent"
                )


def pack_header(files: Iterable[PackedFile], directory: str) -> tuple[bytes, list[PackedFile]]:
    """The pack's header (length prefix included) for `files`, in path order, and the files
    with their offsets in its data section. Canonical (sorted keys, no times): the same
    files give the same bytes, so storing them again moves nothing."""
    ordered = sorted(files, key=lambda f: f.path)
    check_paths((f.path for f in ordered), directory)
    entries: dict[str, object] = {}
    placed = []
    offset = 0
    for f in ordered:
        entries[f.path] = {
            "dtype": _DTYPE,
            "shape": [f.size],
            "data_offsets": [offset, offset + f.size],
        }
        placed.append(PackedFile(f.path, f.size, f.mode & MODE_BITS, offset))
        offset += f.size
    modes = {f.path: f.mode for f in placed}
    entries[METADATA_KEY] = {FILES_KEY: json.dumps(modes, sort_keys=True, separators=(",", ":"))}
    raw = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-(LENGTH_PREFIX_BYTES + len(raw)) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw, placed


def is_pack(header: CheckpointHeader) -> bool:
    """Whether a member's header is a pack's (a directory whose own file happens to be
    named .files.safetensors, stored without --all-files, keeps it as a file)."""
    return FILES_KEY in (header.metadata or {})


def packed_files(header: CheckpointHeader, directory: str) -> list[PackedFile]:
    """The files a pack's header lists, every path and mode checked against its tensors:
    read back from a node, a planted path is refused before anything is written."""
    try:
        modes = json.loads((header.metadata or {})[FILES_KEY])
    except (KeyError, json.JSONDecodeError):
        modes = None
    names = sorted(t.name for t in header.tensors)
    if not isinstance(modes, dict) or sorted(modes) != names:
        raise UnsafeNameError(
            f"the file list of directory checkpoint {directory} does not match its pack's"
            " tensors; it was not written by smoltorrent. Store the directory again."
        )
    check_paths(names, directory)
    files = []
    for t in header.tensors:
        mode = modes[t.name]
        if t.dtype != _DTYPE or len(t.shape) != 1 or type(mode) is not int or mode & ~MODE_BITS:
            raise UnsafeNameError(
                f"{t.name!r} in directory checkpoint {directory}'s pack is not a file's bytes"
                f" with permission bits (dtype {t.dtype}, mode {mode!r}); it was not written"
                " by smoltorrent. Store the directory again."
            )
        files.append(PackedFile(t.name, t.size, mode, t.start))
    return files
