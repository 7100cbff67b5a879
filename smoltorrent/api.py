"""The Python API for training loops: save and load training state through the cluster.

    import smoltorrent

    handle = smoltorrent.save(state, "run1/latest", wait=False)
    ...                                     # training goes on while the store runs
    state = smoltorrent.load("run1/latest", framework="torch")

`save` stalls the training step only for one copy of the tensors' bytes into shared
memory and an fsync'd journal record of the save (smoltorrent/snapshot.py); it raises
only for what the caller must fix (a bad name, a value a state cannot hold, a full
disk), never because a worker, Redis or the cluster is away. A writer process of this
trainer (smoltorrent/snapshot_writer.py, started on the first save, in its own
session) writes the staged .safetensors file from the snapshot, fsyncs it, and asks
for its store through tasks/requests.py, the one way in that the CLI and the watcher
use too, retrying while nothing answers; saves of one name are stored in the order
they were made. Once its version is committed the staged file joins the local tier
(smoltorrent/local_tier.py: the machine's last saves, which load reads first once
checked against the manifest); it is kept (the error names it) when the store fails.
The writer outlives the trainer: a script that ends, or is killed, right after `save`
returns still has its saves stored, and a save whose trainer and writer both died is
taken up by the next writer on the machine (the next save or load).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from coordinator import config
from coordinator.plan.file_pack import PACK_FILE, is_pack
from coordinator.plan.manifest import Manifest
from coordinator.plan.safetensors_header import parse_header, read_header
from coordinator.plan.selection import pick
from coordinator.plan.version_ids import check_name
from coordinator.state.directories import Directories
from coordinator.state.versions import COMMITTED
from smoltorrent import defaults, local_tier, snapshot
from smoltorrent.errors import NotFoundError, SmoltorrentError, StateDictError
from smoltorrent.keypaths import STATE_KEY, flatten, parse_structure, paths, unflatten
from smoltorrent.tensors import check_framework, check_metadata, read_file
from tasks.context import metadata
from tasks.requests import ride_out, submit_gather, wait_gather

log = logging.getLogger("smoltorrent")
T = TypeVar("T")
SOURCES = ("auto", "local", "cluster")  # where load reads from


@dataclass(frozen=True)
class SavedVersion:
    """A committed version of a name."""

    name: str
    version_id: str  # 64 hex: the content's id, as `smoltorrent ls` shows it
    new: bool  # False when the cluster already held these bytes (nothing moved)
    size: int  # bytes of the safetensors file


class SaveHandle:
    """A save in flight. `done()`, `result(timeout)`, `version_id` (waits for the commit)."""

    def __init__(self, name: str, path: str, log: str) -> None:
        self.name = name
        self.path = path  # the staged local file; moved to the local tier once committed
        self.log = log  # the writer's log, where a save that takes long says why
        self._future: concurrent.futures.Future[SavedVersion] = concurrent.futures.Future()

    def done(self) -> bool:
        """Whether the store has ended (committed or failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SavedVersion:
        """The committed version; SmoltorrentError if the store failed, TimeoutError if it
        has not ended within `timeout` seconds (it goes on in the background)."""
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise TimeoutError(
                f"the save of {self.name!r} has not ended within {timeout} s; it goes on in "
                f"the background (handle.result() waits again), and its writer's log "
                f"{self.log} says what it waits for"
            ) from None

    @property
    def version_id(self) -> str:
        """The committed version's id; waits for the commit."""
        return self.result().version_id

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<SaveHandle {self.name} {state}>"


def save(
    state: Mapping[str, Any],
    name: str,
    *,
    replicas: int = defaults.DEFAULT_REPLICAS,
    wait: bool = True,
    metadata: Mapping[str, str] | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
    bwlimit: int | None = None,
) -> SavedVersion | SaveHandle:
    """Store a state as a version of `name`: a state dict of torch tensors, numpy arrays
    or MLX arrays, or a training run's whole state (dicts, lists and tuples of them and
    of plain values: model, optimizer, scheduler, RNG states, step; smoltorrent/
    keypaths.py). With wait=True, return the committed version; with wait=False, return
    a SaveHandle as soon as the snapshot is taken and the save journalled.

    bwlimit: bytes/s the store's sends from this host keep to together, so the training's
    own traffic keeps the rest of the link (0: none; default SMOLTORRENT_BWLIMIT)."""
    handle = start_save(state, name, replicas, metadata, staging_dir, bwlimit=bwlimit)
    return handle.result() if wait else handle


def start_save(
    state: Mapping[str, Any],
    name: str,
    replicas: int,
    metadata: Mapping[str, str] | None,
    staging_dir: str | os.PathLike[str] | None,
    step: dict[str, Any] | None = None,
    *,
    bwlimit: int | None = None,
) -> SaveHandle:
    """save(..., wait=False); `step` (smoltorrent/sharded.py) has the writer record the
    committed version as a rank's part of a step before the handle reports it."""
    if not isinstance(name, str) or not name.strip():
        raise SmoltorrentError(f"a checkpoint name must be a non-empty string, not {name!r}")
    check_name(name)
    if replicas < 1:
        raise SmoltorrentError(f"replicas must be at least 1, not {replicas}")
    flat = flatten(state)
    header = check_metadata(metadata, STATE_KEY)
    if flat.structure is not None:
        header = {**(header or {}), STATE_KEY: flat.structure}
    directory = _staging_dir(staging_dir)
    writer = _writer(directory)
    job = snapshot.take(flat, header, name, replicas, step, directory, writer.pool, bwlimit=bwlimit)
    handle = SaveHandle(name, job.staged, str(writer.log))
    writer.send(job, handle)
    return handle


class _WriterClient:
    """This process's writer for one staging directory: job records in on its stdin,
    results out on its stdout, each resolving its save's handle."""

    def __init__(self, staging: Path) -> None:
        self.staging = staging
        self.log = snapshot.journal_dir(staging) / "writer.log"  # the writer's stderr
        self.lock = threading.Lock()
        self.pending: dict[str, tuple[snapshot.Job, SaveHandle]] = {}
        self.proc: subprocess.Popen | None = None
        self.pool = snapshot.Pool()
        _save_failures()

    def _start(self) -> subprocess.Popen:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "smoltorrent.snapshot_writer", str(self.staging)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # a Ctrl-C or kill of the trainer leaves it working
                cwd=os.getcwd(),
            )
        threading.Thread(
            target=self._results, args=(proc,), name="smoltorrent-writer", daemon=True
        ).start()
        return proc

    def start(self) -> None:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()

    def send(self, job: snapshot.Job, handle: SaveHandle) -> None:
        with self.lock:
            self.pending[job.id] = (job, handle)
            for _ in range(2):
                if self.proc is None or self.proc.poll() is not None:
                    self.proc = self._start()
                try:
                    self.proc.stdin.write(job.record.encode() + b"\n")
                    self.proc.stdin.flush()
                    return
                except (BrokenPipeError, OSError):
                    self.proc = None
            # No writer would take it: the journal keeps it for the next one.
            del self.pending[job.id]
            job.release()
            handle._future.set_exception(
                SmoltorrentError(
                    f"no writer process could be started for {handle.name}; the save is "
                    f"journalled in {snapshot.journal_dir(self.staging)} and the next save "
                    "or load on this machine stores it"
                )
            )

    def _results(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            message = json.loads(line)
            with self.lock:
                if message.get("staged"):
                    entry = self.pending.get(message["id"])
                else:
                    entry = self.pending.pop(message["id"], None)
            if entry is None:
                continue  # an adopted save of another process
            job, handle = entry
            if message.get("staged"):  # its snapshot is on disk: the pages can serve again
                if job.buffer is not None:
                    self.pool.put(job.buffer)
                    job.buffer = None
                continue
            job.release()
            if job.buffer is not None:  # adopted by a new writer, which deleted the file
                job.buffer.close(unlink=False)
                job.buffer = None
            if not message["ok"]:
                log.error("%s", message["error"])
                _save_failures().inc()
            if message["ok"]:
                handle._future.set_result(
                    SavedVersion(
                        handle.name, message["version_id"], message["new"], message["size"]
                    )
                )
            else:
                handle._future.set_exception(_error_class(message)(message["error"]))
        proc.wait()
        with self.lock:
            if self.proc is not proc:
                return
            self.proc = None
            orphans = list(self.pending.values())
            if not orphans:
                return
            # The writer died with saves of ours: free their records for a new writer,
            # which adopts them and reports them here.
            for job, _ in orphans:
                job.release()
            self.proc = self._start()


def _error_class(message: dict[str, Any]) -> type[SmoltorrentError]:
    """The writer's error class, by name, when smoltorrent.errors has it (a step's
    WorldSizeMismatchError stays one); SmoltorrentError otherwise."""
    from smoltorrent import errors

    found = getattr(errors, str(message.get("type")), None)
    ok = isinstance(found, type) and issubclass(found, SmoltorrentError)
    return found if ok else SmoltorrentError


_failures: list[Any] = []  # the counter, made on first use


def _save_failures() -> Any:
    """smoltorrent_save_failures_total in this process's default Prometheus registry (what
    prometheus_client.start_http_server serves): saves whose store failed, each also on
    its handle's result() and in the log. Made on the first save, so it reads 0 before
    any failure."""
    if not _failures:
        from prometheus_client import Counter

        _failures.append(
            Counter(
                "smoltorrent_save_failures",
                "Saves of this process whose store failed (handle.result() raises).",
            )
        )
    return _failures[0]


_writers: dict[Path, _WriterClient] = {}
_writers_lock = threading.Lock()


def _writer(staging: Path) -> _WriterClient:
    with _writers_lock:
        client = _writers.get(staging)
        if client is None:
            client = _writers[staging] = _WriterClient(staging)
        return client


def _staging_dir(staging_dir: str | os.PathLike[str] | None) -> Path:
    directory = Path(staging_dir) if staging_dir is not None else config.home() / "staging"
    directory.mkdir(parents=True, exist_ok=True)
    return directory.resolve()


def load(
    name: str,
    *,
    version: str | None = None,
    framework: str = "torch",
    tensors: Sequence[str] | None = None,
    device: str | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
    bwlimit: int | None = None,
    source: str = "auto",
) -> Any:
    """The state of `name` (its current version, or a version id prefix; `NAME@LABEL` reads
    the version tagged LABEL, `NAME@VERSION` the version of that id prefix) as it was saved,
    with `framework` tensors, gathered and verified byte for byte: a flat state dict as a
    dict, a nested state as the same dicts, lists, tuples and plain values.

    `source`: "auto" reads this machine's kept copy of the version (the local tier,
    smoltorrent/local_tier.py) when every byte of it matches the version's manifest, and
    the cluster otherwise; "cluster" reads the cluster only; "local" the kept copy only
    (NotFoundError when there is none or it is bad). A partial load reads the cluster.

    With `tensors` (names or globs, e.g. ["model.layers.0.*", "lm_head.weight"]; for a
    nested state, key paths such as ["model/*", "optim/*"]), only what they match: of a
    chunked version (the default) only the chunks holding them are read, in parallel, each
    checked against its digests; of one in whole shards only the tensors' byte ranges,
    each checked against the SHA-256 recorded for it at store time (versions stored before
    those digests existed have their needed shards read whole and checked against the
    shard's digest). A glob matching nothing is an error. bwlimit: bytes/s the gather
    receives at most (0: none; default SMOLTORRENT_BWLIMIT)."""
    check_framework(framework)
    if source not in SOURCES:
        raise SmoltorrentError(f"source= is one of {', '.join(SOURCES)}, not {source!r}")
    if source == "local" and tensors is not None:
        raise SmoltorrentError(
            "source='local' reads a whole save; leave tensors= out, or use source='auto' "
            "(a partial load reads the cluster)"
        )
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
    if snapshot.has_orphans(directory):
        _writer(directory).start()  # it adopts the saves a dead trainer left
    name, version = _at(name, version)
    if _read(lambda: Directories(metadata().r).is_directory(name), name):
        if source == "local":
            raise NotFoundError(f"{name} is a directory checkpoint: the local tier keeps saves")
        if bwlimit:
            raise SmoltorrentError(
                f"bwlimit applies to a checkpoint file, and {name} is a directory checkpoint:"
                " load one of its files (name/FILE), or leave bwlimit out"
            )
        return _load_directory(name, version, framework, tensors, device, directory)
    tree, chosen = None, None
    if tensors is not None:
        tree, version, tensors, chosen = _select(name, version, tensors)
    out = directory / f".load.{uuid.uuid4().hex}.safetensors"
    try:
        if (
            tensors is None
            and source != "cluster"
            and _local_copy(name, version, directory, out, source)
        ):
            loaded = read_file(str(out), framework, device)
            tree = parse_structure(read_header(str(out)).metadata)
        elif tensors is None or tensors:
            wait_gather(submit_gather(name, str(out), version, tensors, bwlimit=bwlimit))
            loaded = read_file(str(out), framework, device)
            if tree is None:
                tree = parse_structure(read_header(str(out)).metadata)
        else:  # only plain values selected: no tensor to gather
            loaded = {}
        return loaded if tree is None else unflatten(tree, loaded, chosen)
    finally:
        out.unlink(missing_ok=True)


def _at(name: str, version: str | None) -> tuple[str, str | None]:
    """`NAME@LABEL` or `NAME@VERSION` as (NAME, that version's id), as `gather` reads it."""
    if "@" not in name:
        return name, version
    base, named = _read(lambda: metadata().versions.split_at(name), name)
    if named is None:
        return name, version
    if version is not None:
        raise SmoltorrentError(f"give {name!r} or version=, not both: {name!r} names a version")
    return base, named


def _local_copy(name: str, version: str | None, staging: Path, out: Path, source: str) -> bool:
    """Whether this machine's kept copy of the version is linked at `out`, checked byte for
    byte against its manifest; with source='local', NotFoundError when it is not."""
    md = metadata()
    vkey = _read(lambda: md.versions.resolve(name, version), name)
    state = _read(lambda: md.versions.state(vkey), name)
    if state == COMMITTED:
        manifest = _read(lambda: md.versions.manifest(vkey), name)
        why = local_tier.link_verified(staging, manifest, out)
    else:
        why = f"the version is {state}, not committed"
    if why is None:
        log.info("%s read from the local tier", name)
        return True
    if source == "local":
        raise NotFoundError(
            f"{name} cannot be read from this machine's local tier ({why}); "
            "load it with source='auto' or 'cluster'"
        )
    return False


def _read(call: Callable[[], T], name: str) -> T:
    """A read of what to load, before its gather, ridden out over a Redis restart of a few
    seconds (ride_out); nothing is recorded yet, so past that it is a MetadataError."""
    return ride_out(call, f"reading what to load of {name}", recorded=False)


def manifest_metadata(manifest: Manifest) -> dict[str, str]:
    """The header metadata of a version, from its manifest (no byte of it gathered)."""
    header = parse_header(
        struct.pack("<Q", len(manifest.header_bytes)),
        manifest.header_bytes,
        manifest.source_size,
        source=f"manifest of {manifest.name}",
    )
    return dict(header.metadata or {})


def _select(
    name: str, version: str | None, patterns: list[str]
) -> tuple[Any, str | None, list[str], set[str] | None]:
    """What a partial load reads: (structure or None, the version id to read, the tensor
    names or globs to gather, the key paths chosen). A saved state's globs match key
    paths of tensors, plain values and containers alike (a container comes whole); a
    flat state dict's go to the gather as they are."""
    md = metadata()
    vkey = _read(lambda: md.versions.resolve(name, version), name)
    tree = parse_structure(manifest_metadata(_read(lambda: md.versions.manifest(vkey), name)))
    version_id = _read(lambda: md.versions.version(vkey), name)["version_id"]
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
    md = metadata()
    found = _read(lambda: Directories(md.r).get(name, version), name)
    files = dict(found.files)
    if PACK_FILE in files:  # the directory's other files (store --all-files): no tensors
        pack = _read(lambda: md.versions.manifest(files[PACK_FILE].vkey), name)
        if is_pack(pack.header()):
            del files[PACK_FILE]
    wanted: dict[str, list[str] | None] = dict.fromkeys(files)
    if tensors is not None:
        manifests = {
            f: _read(lambda m=m: md.versions.manifest(m.vkey), name) for f, m in files.items()
        }
        names = {f: [t.name for t in m.header().tensors] for f, m in manifests.items()}
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
