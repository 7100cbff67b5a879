"""The watchdog enqueuer: every complete new or rewritten `*.safetensors` under a
directory is submitted as a store, named by its path relative to that directory.

A file is complete when it has not been written for STABLE_AFTER_S and its
safetensors header accounts for every byte of it: a checkpoint still being written
(in place, or under a temp name before a rename) stays in the pending list and is
looked at again every WATCH_RECHECK_S, or at once when the writer closes it
(inotify's close-write, where the platform has it). Identical content stores
nothing (versions are content-addressed); new content makes a new version.

On start, and whenever the directory comes back after vanishing, every file that
no stored version was taken from (size, mtime, inode, device) is picked up: what
training wrote while the watcher was down is stored too (the seed's file_sync).

A directory holding a `*.safetensors.index.json` is a Hugging Face multi-file
checkpoint: its files are stored together, as one unit named by the directory, once
the index and every file are complete and agree (`submit_directory`); a part is
never stored on its own while the index that names it is still to come.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from coordinator.plan.directory import INDEX_SUFFIX, plan_directory
from coordinator.plan.safetensors_header import read_header
from coordinator.plan.source_file import SourceIdentity
from coordinator.state.metadata import Metadata
from coordinator.state.versions import COMMITTED, PENDING
from smoltorrent import defaults
from smoltorrent.errors import (
    CheckpointFormatError,
    IncompleteCheckpointError,
    NotFoundError,
    SmoltorrentError,
    UsageError,
)
from smoltorrent.signal_event import SignalEvent

log = logging.getLogger("smoltorrent.watch")

SUFFIX = ".safetensors"

Submit = Callable[[str, str], str]  # (path, name) -> task id
SubmitDirectory = Callable[[str, str], None]  # (directory, name); stores it as one unit


def checkpoint_name(root: Path, path: Path, prefix: str = "") -> str:
    """The stored name of `path`: its path relative to the watched root, behind the prefix."""
    rel = path.relative_to(root).as_posix()
    return f"{prefix.rstrip('/')}/{rel}" if prefix.strip("/") else rel


class _Events(FileSystemEventHandler):
    """Turns watchdog events into paths to look at; never touches the files itself."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory:
            if event.event_type in ("created", "moved"):
                # A directory moved or made in place may already hold checkpoints.
                self.watcher.rescan_soon()
            return
        path = os.fsdecode(getattr(event, "dest_path", "") or event.src_path)
        if event.event_type in ("created", "modified", "moved", "closed"):
            self.watcher.notice(Path(path), closed=event.event_type == "closed")


class Watcher:
    """Watches `root` until stop(); `submit(path, name)` queues a store."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        submit: Submit,
        *,
        name_prefix: str = "",
        stored_identities: Callable[[str], set[SourceIdentity]] | None = None,
        submit_directory: SubmitDirectory | None = None,
        recheck_s: float = defaults.WATCH_RECHECK_S,
        settle_s: float = defaults.STABLE_AFTER_S,
    ) -> None:
        self.root = Path(root).absolute()
        self.submit = submit
        self.name_prefix = name_prefix
        self.stored_identities = stored_identities or (lambda _name: set())
        self.submit_directory = submit_directory
        self.recheck_s = recheck_s
        self.settle_s = settle_s
        self._lock = threading.Lock()
        # stop() is called from a signal handler: a threading.Event there can deadlock
        # (smoltorrent/signal_event.py).
        self._wake = SignalEvent()
        self._stop = SignalEvent()
        self._pending: set[Path] = set()
        self._rescan = True  # file_sync at start
        self._submitted: dict[Path, SourceIdentity] = {}
        self._units: set[Path] = set()  # directories with an index, waiting to be complete
        self._submitted_units: dict[Path, frozenset[SourceIdentity]] = {}
        self._logged: dict[Path, object] = {}  # what was last said about a path, said once
        self._observer: Observer | None = None
        self._root_id: tuple[int, int] | None = None
        self._root_missing_logged = False

    # --- fed by the observer thread -------------------------------------------------

    def notice(self, path: Path, closed: bool = False) -> None:
        with self._lock:
            self._pending.add(path)
        if closed:
            self._wake.set()

    def rescan_soon(self) -> None:
        with self._lock:
            self._rescan = True
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def pending(self) -> list[Path]:
        with self._lock:
            return sorted(self._pending)

    # --- the loop -------------------------------------------------------------------

    def run(self) -> None:
        """Watch until stop() (from a signal handler or another thread)."""
        try:
            while not self._stop.is_set():
                self._follow_root()
                self._check_pending()
                self._check_units()
                self._wake.wait(self.recheck_s)
                self._wake.clear()
        finally:
            self._unschedule()

    def _follow_root(self) -> None:
        """(Re)attach the observer when the directory appears, is replaced or vanishes."""
        try:
            st = os.stat(self.root)
            root_id = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            root_id = None
        if root_id is None:
            self._unschedule()
            self._root_id = None
            if not self._root_missing_logged:
                log.warning("%s is gone; waiting for it to come back", self.root)
                self._root_missing_logged = True
            return
        if root_id != self._root_id or not self._observer_alive():
            self._unschedule()
            observer = Observer()
            observer.schedule(_Events(self), str(self.root), recursive=True)
            observer.start()
            self._observer, self._root_id = observer, root_id
            log.info("watching %s for *%s", self.root, SUFFIX)
            if self._root_missing_logged:
                log.info("%s is back; looking for checkpoints written meanwhile", self.root)
                self._root_missing_logged = False
            self._rescan = True
        with self._lock:
            rescan, self._rescan = self._rescan, False
        if rescan:
            self._file_sync()

    def _observer_alive(self) -> bool:
        return self._observer is not None and self._observer.is_alive()

    def _unschedule(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join()
            self._observer = None

    def _file_sync(self) -> None:
        """Every checkpoint under the root that no stored version came from goes pending."""
        found = 0
        for dirpath, _dirs, files in os.walk(self.root):
            for file in files:
                path = Path(dirpath, file)
                if not file.endswith(SUFFIX) or file.startswith("."):
                    continue
                try:
                    identity = SourceIdentity.of(path)
                except FileNotFoundError:
                    continue
                if self._submitted.get(path) == identity:
                    continue
                name = checkpoint_name(self.root, path, self.name_prefix)
                try:
                    known = self.stored_identities(name)
                except SmoltorrentError as exc:
                    self._say_once(path, ("lookup", str(exc)), logging.WARNING, "%s", exc)
                    known = set()
                if identity in known:
                    self._submitted[path] = identity
                    continue
                with self._lock:
                    self._pending.add(path)
                found += 1
        if found:
            log.info("file_sync: %d checkpoint(s) under %s not stored yet", found, self.root)

    def _check_pending(self) -> None:
        for path in self.pending():
            if self._stop.is_set():
                return
            if self._settled(path):
                with self._lock:
                    self._pending.discard(path)

    def _settled(self, path: Path) -> bool:
        """Look at one pending path; True once nothing more is to be done with it."""
        if self.submit_directory and _unit_of(path):
            self._units.add(path.parent)  # stored with its directory, not on its own
            return True
        if not path.name.endswith(SUFFIX) or path.name.startswith("."):
            # Hidden names are the usual temp files of the save-then-rename pattern.
            self._say_once(path, "ignored", logging.INFO, "ignoring %s: not a *%s", path, SUFFIX)
            return True
        try:
            identity = SourceIdentity.of(path)
        except (FileNotFoundError, NotADirectoryError):
            return True  # renamed away or deleted: its new name has its own event
        if self._submitted.get(path) == identity:
            return True
        if time.time() - identity.mtime_ns / 1e9 < self.settle_s:
            return False  # still being written
        try:
            read_header(path)
        except IncompleteCheckpointError:
            # Shorter than its header says: its writer paused longer than the settle time.
            # Said once (not again at each pause), and looked at again until it is whole.
            self._say_once(
                path, "writing", logging.INFO, "waiting for %s: still being written", path
            )
            return False
        except CheckpointFormatError as exc:
            # A stable file the header does not account for: junk, or a writer that paused.
            # Either way it is looked at again only when it changes.
            self._say_once(path, identity, logging.WARNING, "not storing %s: %s", path, exc)
            return True
        except OSError as exc:
            self._say_once(path, ("unreadable", str(exc)), logging.WARNING, "%s", exc)
            return False
        name = checkpoint_name(self.root, path, self.name_prefix)
        try:
            task_id = self.submit(str(path), name)
        except (CheckpointFormatError, UsageError) as exc:  # a bad file, or a bad name
            self._say_once(path, identity, logging.WARNING, "not storing %s: %s", path, exc)
            return True
        except SmoltorrentError as exc:
            # No worker or no Redis yet: keep it pending and say so once.
            self._say_once(path, ("submit", str(exc)), logging.WARNING, "%s", exc)
            return False
        self._submitted[path] = identity
        self._logged.pop(path, None)
        log.info("event=queued name=%s path=%s size=%d task=%s", name, path, identity.size, task_id)
        return True

    def _check_units(self) -> None:
        for unit in sorted(self._units):
            if self._stop.is_set():
                return
            if self._unit_settled(unit):
                self._units.discard(unit)

    def _unit_settled(self, unit: Path) -> bool:
        """Look at one directory with an index; True once nothing more is to be done."""
        try:
            entries = [unit / e for e in os.listdir(unit) if not e.startswith(".")]
            parts = [p for p in entries if p.name.endswith((SUFFIX, INDEX_SUFFIX))]
            identities = frozenset(SourceIdentity.of(p) for p in parts if p.is_file())
        except (FileNotFoundError, NotADirectoryError):
            return True  # gone; what it becomes has its own events
        if not any(p.name.endswith(INDEX_SUFFIX) for p in parts):
            # The index went away: its files are plain checkpoints again.
            with self._lock:
                self._pending.update(p for p in parts if p.name.endswith(SUFFIX))
            return True
        if self._submitted_units.get(unit) == identities:
            return True
        if any(time.time() - i.mtime_ns / 1e9 < self.settle_s for i in identities):
            return False  # still being written
        try:
            plan_directory(unit)
        except SmoltorrentError as exc:
            # Parts still to come (the index is often written first or last) or a layout
            # the index contradicts: looked at again until it agrees.
            self._say_once(
                unit, ("unit", str(exc)), logging.WARNING, "waiting on %s: %s", unit, exc
            )
            return False
        except OSError as exc:
            self._say_once(unit, ("unreadable", str(exc)), logging.WARNING, "%s", exc)
            return False
        name = checkpoint_name(self.root, unit, self.name_prefix)
        try:
            self.submit_directory(str(unit), name)
        except UsageError as exc:  # a name no checkpoint may have: waiting will not fix it
            self._say_once(
                unit, ("name", str(exc)), logging.WARNING, "not storing %s: %s", unit, exc
            )
            return True
        except SmoltorrentError as exc:
            self._say_once(unit, ("submit", str(exc)), logging.WARNING, "%s", exc)
            return False
        self._submitted_units[unit] = identities
        for part in parts:
            if part.name.endswith(SUFFIX):
                self._submitted[part] = SourceIdentity.of(part)
        self._logged.pop(unit, None)
        log.info("event=queued-directory name=%s path=%s files=%d", name, unit, len(parts) - 1)
        return True

    def _say_once(self, path: Path, what: object, level: int, msg: str, *args) -> None:
        if self._logged.get(path) != what:
            self._logged[path] = what
            log.log(level, msg, *args)


def _unit_of(path: Path) -> bool:
    """Whether `path` belongs to a directory checkpoint: it is the index, or a
    .safetensors file beside one."""
    if path.name.startswith("."):
        return False
    if path.name.endswith(INDEX_SUFFIX):
        return True
    if not path.name.endswith(SUFFIX):
        return False
    try:
        return any(e.endswith(INDEX_SUFFIX) for e in os.listdir(path.parent))
    except OSError:
        return False


def stored_identities_from(md: Metadata) -> Callable[[str], set[SourceIdentity]]:
    """The source identities the live versions of a name were taken from, from Redis."""

    def identities(name: str) -> set[SourceIdentity]:
        out = set()
        for vkey in md.versions.versions(name):
            try:
                v = md.versions.version(vkey)
            except NotFoundError:
                continue
            if v.get("state") in (PENDING, COMMITTED) and v.get("identity"):
                out.add(SourceIdentity.from_dict(json.loads(v["identity"])))
        return out

    return identities
