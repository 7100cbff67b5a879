"""The Python API for training loops: save and load training state through the cluster.

    import smoltorrent

    handle = smoltorrent.save(model.state_dict(), "run1/latest", wait=False)
    ...                                     # training goes on while the store runs
    state = smoltorrent.load("run1/latest", framework="torch")

`save` writes a local .safetensors file (under SMOLTORRENT_HOME/staging, or
`staging_dir`) with the framework's own writer, atomically (a temp name, then a
rename), then asks for its store through tasks/requests.py, the one way in that the
CLI and the watcher use too: the request is durable before `save` returns. The
training step stalls only for the local write. The staged file is deleted once its
version is committed on the nodes, and kept (the error names it) when the store
fails.

Saves of one name from one process run in order: a second save while the first is in
flight writes its file at once and is queued behind the first (never two stores of
one name interleaved). A queued save is submitted from this process when the one
before it ends, so it is durable only from then on. The interpreter waits at exit for
the saves it still has in flight.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import struct
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator import config
from coordinator.plan.safetensors_header import parse_header, read_header
from coordinator.plan.selection import pick
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError, SmoltorrentError, StateDictError
from smoltorrent.keypaths import STATE_KEY, flatten, parse_structure, paths, unflatten
from smoltorrent.tensors import check_framework, check_metadata, read_file, write_file
from tasks.directory_requests import directory_version, is_directory
from tasks.requests import (
    StoreRequest,
    connected_metadata,
    submit_gather,
    submit_store,
    wait_gather,
    wait_store,
)

_STEM_CHARS = re.compile(r"[^A-Za-z0-9._-]+")
_STEM_MAX_CHARS = 80  # characters of the name kept in a staged file's name; the rest is a uuid


@dataclass(frozen=True)
class SavedVersion:
    """A committed version of a name."""

    name: str
    version_id: str  # 64 hex: the content's id, as `smoltorrent ls` shows it
    new: bool  # False when the cluster already held these bytes (nothing moved)
    size: int  # bytes of the safetensors file


class SaveHandle:
    """A save in flight. `done()`, `result(timeout)`, `version_id` (waits for the commit)."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path  # the staged local file, deleted once the version is committed
        self._future: concurrent.futures.Future[SavedVersion] = concurrent.futures.Future()

    def done(self) -> bool:
        """Whether the store has ended (committed or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SavedVersion:
        """The committed version; SmoltorrentError if the store failed, TimeoutError if it
        has not ended within `timeout` seconds (it goes on in the background)."""
        return self._future.result(timeout)

    @property
    def version_id(self) -> str:
        """The committed version's id; waits for the commit."""
        return self.result().version_id

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<SaveHandle {self.name} {state}>"


_lock = threading.Lock()
_latest: dict[str, SaveHandle] = {}  # per name, the save every new one queues behind


def save(
    state: Mapping[str, Any],
    name: str,
    *,
    replicas: int = defaults.DEFAULT_REPLICAS,
    wait: bool = True,
    metadata: Mapping[str, str] | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
) -> SavedVersion | SaveHandle:
    """Store a state as a version of `name`: a state dict of torch tensors, numpy arrays
    or MLX arrays, or a training run's whole state (dicts, lists and tuples of them and
    of plain values: model, optimizer, scheduler, RNG states, step; smoltorrent/
    keypaths.py). With wait=True, return the committed version; with wait=False, return
    a SaveHandle as soon as the local file is written."""
    handle = start_save(state, name, replicas, metadata, staging_dir)
    return handle.result() if wait else handle


def start_save(
    state: Mapping[str, Any],
    name: str,
    replicas: int,
    metadata: Mapping[str, str] | None,
    staging_dir: str | os.PathLike[str] | None,
    then: Callable[[SavedVersion], None] | None = None,
) -> SaveHandle:
    """save(..., wait=False), with `then(saved)` run once the version is committed and
    before the handle reports it (its error becomes the handle's)."""
    if not isinstance(name, str) or not name.strip():
        raise SmoltorrentError(f"a checkpoint name must be a non-empty string, not {name!r}")
    if replicas < 1:
        raise SmoltorrentError(f"replicas must be at least 1, not {replicas}")
    flat = flatten(state)
    header = check_metadata(metadata, STATE_KEY)
    if flat.structure is not None:
        header = {**(header or {}), STATE_KEY: flat.structure}
    path = _write_staged(flat.tensors, name, flat.framework, header, staging_dir)
    handle = SaveHandle(name, path)
    with _lock:
        previous = _latest.get(name)
        _latest[name] = handle
    request = None
    if previous is None or previous.done():
        previous = None
        try:
            request = submit_store(path, name, replicas, complete=True)
        except BaseException:
            os.unlink(path)
            with _lock:
                if _latest.get(name) is handle:
                    del _latest[name]
            raise
    # Not a daemon: the interpreter waits for saves in flight before it exits.
    threading.Thread(
        target=_follow,
        args=(handle, previous, request, replicas, then),
        name=f"smoltorrent-save-{name}",
    ).start()
    return handle


def _follow(
    handle: SaveHandle,
    previous: SaveHandle | None,
    request: StoreRequest | None,
    replicas: int,
    then: Callable[[SavedVersion], None] | None,
) -> None:
    try:
        _fsync(handle.path)
        if request is None:
            concurrent.futures.wait([previous._future])
            request = submit_store(handle.path, handle.name, replicas, complete=True)
        out = wait_store(request)
        v = connected_metadata().versions.version(out["vkey"])
        saved = SavedVersion(handle.name, v["version_id"], bool(out["new"]), int(v["size"]))
    except BaseException as exc:
        handle._future.set_exception(
            SmoltorrentError(
                f"{exc} The state dict is kept at {handle.path}: `smoltorrent store "
                f"{handle.path} --name {handle.name}` stores it once the cause is fixed."
            )
        )
    else:
        os.unlink(handle.path)
        try:
            if then is not None:
                then(saved)
        except BaseException as exc:
            wrapped = exc if isinstance(exc, SmoltorrentError) else SmoltorrentError(str(exc))
            handle._future.set_exception(wrapped)
        else:
            handle._future.set_result(saved)
    finally:
        with _lock:
            if _latest.get(handle.name) is handle:
                del _latest[handle.name]


def _staging_dir(staging_dir: str | os.PathLike[str] | None) -> Path:
    directory = Path(staging_dir) if staging_dir is not None else config.home() / "staging"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _write_staged(
    state_dict: Mapping[str, Any],
    name: str,
    framework: str,
    metadata: dict[str, str] | None,
    staging_dir: str | os.PathLike[str] | None,
) -> str:
    """Write the state dict beside its final name, then rename: the store never sees a
    half-written file. Not fsynced here: the training step would wait for the disk."""
    directory = _staging_dir(staging_dir)
    stem = f"{_STEM_CHARS.sub('_', name)[-_STEM_MAX_CHARS:]}.{uuid.uuid4().hex[:12]}"
    final = directory / f"{stem}.safetensors"
    # MLX appends .safetensors to any other suffix, so the temp name ends with it too.
    tmp = directory / f".{stem}.partial.safetensors"
    try:
        write_file(state_dict, str(tmp), framework, metadata)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return str(final)


def _fsync(path: str) -> None:
    """Flush the staged file and its directory entry while the store starts, so a power
    cut after this point cannot hand the re-driven store a torn file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(
    name: str,
    *,
    version: str | None = None,
    framework: str = "torch",
    tensors: Sequence[str] | None = None,
    device: str | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """The state of `name` (its current version, or a version id prefix) as it was saved,
    with `framework` tensors, gathered and verified byte for byte: a flat state dict as a
    dict, a nested state as the same dicts, lists, tuples and plain values.

    With `tensors` (names or globs, e.g. ["model.layers.0.*", "lm_head.weight"]; for a
    nested state, key paths such as ["model/*", "optim/*"]), only what they match: the
    tensors' byte ranges alone are read from the shards holding them, in parallel, each
    checked against the SHA-256 recorded for it at store time (versions stored before
    those digests existed have their needed shards read whole and checked against the
    shard's digest). A glob matching nothing is an error."""
    check_framework(framework)
    if device is not None and framework != "torch":
        raise StateDictError(f"device= applies to framework='torch' only, not {framework!r}")
    if tensors is not None:
        if isinstance(tensors, str) or not all(isinstance(t, str) for t in tensors):
            raise SmoltorrentError(
                f"tensors= takes a list of names or globs, not {tensors!r}"
                + (f"; write tensors=[{tensors!r}]" if isinstance(tensors, str) else "")
            )
        if not tensors:
            raise SmoltorrentError("tensors=[] selects nothing; leave it out to load every tensor")
        tensors = list(tensors)
    directory = _staging_dir(staging_dir)
    if is_directory(name):
        return _load_directory(name, version, framework, tensors, device, directory)
    tree, chosen = None, None
    if tensors is not None:
        tree, version, tensors, chosen = _select(name, version, tensors)
    out = directory / f".load.{uuid.uuid4().hex}.safetensors"
    try:
        if tensors is None or tensors:
            wait_gather(submit_gather(name, str(out), version, tensors))
            loaded = read_file(str(out), framework, device)
            if tree is None:
                tree = parse_structure(read_header(str(out)).metadata)
        else:  # only plain values selected: no tensor to gather
            loaded = {}
        return loaded if tree is None else unflatten(tree, loaded, chosen)
    finally:
        out.unlink(missing_ok=True)


def _select(
    name: str, version: str | None, patterns: list[str]
) -> tuple[Any, str | None, list[str], set[str] | None]:
    """What a partial load reads: (structure or None, the version id to read, the tensor
    names or globs to gather, the key paths chosen). A saved state's globs match key
    paths of tensors, plain values and containers alike (a container comes whole); a
    flat state dict's go to the gather as they are."""
    md = connected_metadata()
    vkey = md.versions.resolve(name, version)
    manifest = md.versions.manifest(vkey)
    header = parse_header(
        struct.pack("<Q", len(manifest.header_bytes)),
        manifest.header_bytes,
        manifest.source_size,
        source=f"manifest of {manifest.name}",
    )
    tree = parse_structure(header.metadata)
    version_id = md.versions.version(vkey)["version_id"]
    if tree is None:
        return None, version_id, patterns, None
    found = list(paths(tree))
    chosen, missing = pick([p for p, _, _ in found], patterns)
    if missing:
        raise NotFoundError(
            f"no key path of {name} matches {missing[0]!r} (its first: "
            f"{', '.join(p for p, _, _ in found[:5])}); `smoltorrent show {name} --tensors` "
            "lists its tensors."
        )
    under = tuple(f"{p}/" for p in chosen)
    wanted = sorted(
        {t for p, _, t in found if t is not None and (p in chosen or p.startswith(under))}
    )
    return tree, version_id, wanted, chosen


def _load_directory(
    name: str,
    version: str | None,
    framework: str,
    tensors: list[str] | None,
    device: str | None,
    directory: Path,
) -> dict[str, Any]:
    """A directory checkpoint's files gathered at once and merged into one state dict; with
    `tensors`, only the files holding a match are read, and of them only the matches."""
    found = directory_version(name, version)
    wanted: dict[str, list[str] | None] = dict.fromkeys(found.files)
    if tensors is not None:
        md = connected_metadata()
        names = {
            f: [t for shard in md.versions.manifest(m.vkey).shards for t in shard.tensors]
            for f, m in found.files.items()
        }
        chosen, missing = pick([t for ts in names.values() for t in ts], tensors)
        if missing:
            raise NotFoundError(
                f"no tensor of {name} matches {missing[0]!r}; `smoltorrent show` on one of "
                "its files lists their tensors."
            )
        wanted = {}
        for f, file_names in names.items():
            if mine := [t for t in file_names if t in chosen]:
                wanted[f] = mine  # exact names: each selects just itself
    paths = {f: directory / f".load.{uuid.uuid4().hex}.safetensors" for f in wanted}
    try:
        requests = [
            submit_gather(found.files[f].name, str(paths[f]), found.files[f].version_id, w)
            for f, w in wanted.items()
        ]
        for request in requests:
            wait_gather(request)
        state: dict[str, Any] = {}
        for f in wanted:
            part = read_file(str(paths[f]), framework, device)
            if clash := sorted(state.keys() & part.keys()):
                raise StateDictError(
                    f"{name}: tensor {clash[0]!r} is in more than one of its files; load the"
                    " files one by one (each is a checkpoint of its own)"
                )
            state.update(part)
        return state
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)
