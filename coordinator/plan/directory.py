"""A directory checkpoint (the Hugging Face layout): several .safetensors files and the
`*.safetensors.index.json` that maps each tensor to its file, stored as one unit.

Each file becomes a checkpoint of its own, `NAME/<file>`; the unit is the set of their
versions plus the index bytes (coordinator/state/directories.py). Planning reads the
index and every file's header only, and refuses a layout the index contradicts: a
gather must hand back a directory that loads.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from coordinator.plan.safetensors_header import read_header
from smoltorrent.errors import CheckpointFormatError, UsageError

SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
_VERSION_DOMAIN = b"smoltorrent directory v1\0"  # keeps these ids apart from any other digest


@dataclass(frozen=True)
class DirectoryPlan:
    root: str
    files: tuple[str, ...]  # the .safetensors files, by name, sorted
    index_name: str | None  # e.g. "model.safetensors.index.json"
    index_bytes: bytes | None  # verbatim
    ignored: tuple[str, ...]  # other files in the directory, not stored


def plan_directory(path: str | os.PathLike[str]) -> DirectoryPlan:
    """The files of the directory at `path` and its index, checked against each other."""
    root = os.path.abspath(os.fspath(path))
    entries = sorted(os.listdir(root))
    files = tuple(e for e in entries if e.endswith(SAFETENSORS_SUFFIX) and _is_file(root, e))
    indexes = [e for e in entries if e.endswith(INDEX_SUFFIX) and _is_file(root, e)]
    ignored = tuple(e for e in entries if e not in files and e not in indexes)
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
    return DirectoryPlan(root, files, index_name, index_bytes, ignored)


def _is_file(root: str, entry: str) -> bool:
    return os.path.isfile(os.path.join(root, entry))


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


def directory_version_id(files: dict[str, str], index_name: str | None, index: bytes | None) -> str:
    """The directory's content id: its files' version ids and its index, canonical."""
    document = {
        "files": dict(sorted(files.items())),
        "index_name": index_name,
        "index_sha256": None if index is None else hashlib.sha256(index).hexdigest(),
    }
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(_VERSION_DOMAIN + canonical).hexdigest()
