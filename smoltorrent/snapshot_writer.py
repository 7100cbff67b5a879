"""The writer process: turns a training process's snapshots into stored versions, off
the trainer's CPU and GIL.

    python -m smoltorrent.snapshot_writer STAGING_DIR

The trainer (smoltorrent/api.py) starts one in its own session, so a Ctrl-C or a
SIGKILL of the trainer does not stop it, and writes the path of each journal record
(smoltorrent/snapshot.py) to its stdin. It runs below the trainer's priority, at nice
defaults.WRITER_NICE with its session's autogroup (smoltorrent/priority.py; 0 in
SMOLTORRENT_WRITER_NICE leaves it at the trainer's), so the steps after a save lose
less of their cores to it, and a busy trainer makes it slower, never stopped. For each
journal record, in order: the staged .safetensors file is written from the
shared-memory snapshot by safetensors' serializer, fsync'd with its directory entry,
and the snapshot deleted; then the store is submitted and followed to its commit, one
save of a name after another. While no worker, Redis or cluster answers, submitting is
retried every SAVE_RETRY_S for SAVE_PATIENCE_S. One JSON line per save goes back on
stdout ({"id", "ok", "version_id", "new", "size"} or {"id", "ok": false, "error"}),
which the trainer turns into its handle's result.

At start and with every save it is handed, a writer adopts the journal's orphans (a
record no live process holds a lock on: its trainer and writer died) and stores them
in the order they were saved. It exits once its trainer has closed its stdin and every
save it holds has ended. A committed save's staged file goes to the local tier
(smoltorrent/local_tier.py), or is deleted when the tier keeps none; a failed store keeps
its staged file (the error names it); a save not submitted within SAVE_PATIENCE_S
keeps its record, for the next writer.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import logging
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from coordinator import config
from coordinator.plan.safetensors_header import read_header
from smoltorrent import defaults, durable, local_tier, priority
from smoltorrent.errors import ConfigError, MetadataError, ShardedCheckpointError, SmoltorrentError
from smoltorrent.snapshot import journal_dir

log = logging.getLogger("smoltorrent.snapshot_writer")


class Lost(SmoltorrentError):
    """A journalled save whose snapshot and staged file are both gone (a power cut before
    the staged file was written)."""


class Writer:
    def __init__(self, staging: Path) -> None:
        self.staging = staging
        self.journal = journal_dir(staging)
        # (record, lock fd, handed over by the trainer rather than adopted)
        self.jobs: collections.deque[tuple[str, int, bool]] = collections.deque()
        self.lent: set[str] = set()  # snapshots staged and left to the trainer to reuse
        self.held: set[str] = set()  # records this writer holds
        self.names: dict[str, collections.deque[dict[str, Any]]] = {}
        self.lock = threading.Condition()
        self.trainer_done = False
        self.out_lock = threading.Lock()
        self.out = sys.stdout

    # --- intake -----------------------------------------------------------------

    def read_trainer(self) -> None:
        for line in sys.stdin:
            path = line.strip()
            if path:
                self.take(path, fcntl.LOCK_SH)
                self.adopt()
        with self.lock:
            self.trainer_done = True
            self.lock.notify_all()

    def take(self, path: str, mode: int) -> bool:
        """Hold the record's lock (shared beside the trainer's, or exclusive to adopt an
        orphan) and queue it; False when it cannot be held or is gone."""
        with self.lock:
            if path in self.held:
                return False
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return False
            try:
                fcntl.flock(fd, mode if mode == fcntl.LOCK_SH else mode | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            if mode != fcntl.LOCK_SH:
                fcntl.flock(fd, fcntl.LOCK_SH)  # adopted: now held like any other
                log.info("adopted %s", os.path.basename(path))
            self.held.add(path)
            self.jobs.append((path, fd, mode == fcntl.LOCK_SH))
            self.lock.notify_all()
            return True

    def adopt(self) -> None:
        if self.journal.is_dir():
            for path in sorted(self.journal.glob("*.json")):  # named by time: saved order
                self.take(str(path), fcntl.LOCK_EX)

    # --- the work -----------------------------------------------------------------

    def run(self) -> None:
        self.adopt()
        while True:
            with self.lock:
                while not self.jobs and not (self.trainer_done and not self.held):
                    self.lock.wait(defaults.WRITER_IDLE_POLL_S)
                if not self.jobs:
                    break
                path, fd, from_trainer = self.jobs.popleft()
            record = json.loads(Path(path).read_text())
            try:
                self.stage(record, from_trainer)
            except BaseException as exc:
                self.finish(path, fd, record, exc, keep_record=not isinstance(exc, Lost))
                continue
            self.sequence(path, fd, record)
        for snapshot in self.lent:  # the trainer is gone: nobody reuses its buffers
            Path(snapshot).unlink(missing_ok=True)

    def stage(self, record: dict[str, Any], from_trainer: bool) -> None:
        """Write the staged file from the snapshot (unless it is there already), fsync it.
        The snapshot goes back to a live trainer, which reuses its pages for its next save."""
        staged = Path(record["staged"])
        snapshot = record["snapshot"]
        if not staged.exists():
            if snapshot is None or not os.path.exists(snapshot):
                raise Lost(
                    f"the snapshot of {record['name']} is gone (the machine restarted before "
                    "it was written to disk); save it again"
                )
            tmp = staged.with_name(f".{staged.stem}.partial.safetensors")
            _serialize(snapshot, record["layout"], record["header"], str(tmp))
            durable.sync_path(str(tmp))
            os.replace(tmp, staged)
        else:
            durable.sync_path(str(staged))  # written by the framework's writer in the trainer
        durable.sync_path(staged.parent)
        if snapshot is None:
            return
        with self.lock:
            lend = from_trainer and not self.trainer_done
            if lend:
                self.lent.add(snapshot)
        if lend:
            self.report({"id": record["id"], "staged": True})
        else:
            Path(snapshot).unlink(missing_ok=True)

    def sequence(self, path: str, fd: int, record: dict[str, Any]) -> None:
        """Saves of one name are stored one after another, in the order they were made."""
        record["_path"], record["_fd"] = path, fd
        with self.lock:
            queue = self.names.get(record["name"])
            if queue is not None:
                queue.append(record)
                return
            self.names[record["name"]] = collections.deque([record])
        threading.Thread(target=self.store_name, args=(record["name"],), daemon=True).start()

    def store_name(self, name: str) -> None:
        while True:
            with self.lock:
                queue = self.names[name]
                if not queue:
                    del self.names[name]
                    return
                record = queue.popleft()
            path, fd = record.pop("_path"), record.pop("_fd")
            try:
                saved = self.store(path, record)
            except BaseException as exc:
                self.finish(path, fd, record, exc, keep_record=isinstance(exc, _Pending))
            else:
                self.finish(path, fd, record, saved, keep_record=False)

    def store(self, path: str, record: dict[str, Any]) -> Any:
        staged, step = record["staged"], record.get("step")
        read_header(staged)  # a bad file fails for good here, never retried
        sidecar = Path(_request_path(path))
        request = sidecar.read_text() if sidecar.exists() else None
        deadline = time.monotonic() + defaults.SAVE_PATIENCE_S
        # A rank's part of a step (smoltorrent/sharded.py) opens the step first; a part
        # whose store was submitted already (adopted) had its step opened then.
        begun = step is None or request is not None
        beating = threading.Event()
        if step is not None:  # others tell this part in flight from a dead one by its beat
            threading.Thread(target=_beat, args=(step, beating), daemon=True).start()
        try:
            return self._store(record, request, sidecar, begun, deadline)
        finally:
            beating.set()

    def _store(
        self,
        record: dict[str, Any],
        request: str | None,
        sidecar: Path,
        begun: bool,
        deadline: float,
    ) -> Any:
        from redis.exceptions import RedisError

        from smoltorrent.api import SavedVersion
        from tasks.requests import StoreRequest, connected_metadata, submit_store, wait_store

        staged, name, step = record["staged"], record["name"], record.get("step")
        last_error = None
        saved = None
        while True:
            try:
                if not begun:
                    from smoltorrent.sharded import begin_part

                    begin_part(step)
                    begun = True
                if saved is not None:
                    from smoltorrent.sharded import record_part

                    record_part(step, name, saved)
                    return saved
                if request is None:
                    request = submit_store(
                        staged,
                        name,
                        record["replicas"],
                        complete=True,
                        bwlimit=record.get("bwlimit"),
                        # A rank's part on a host no worker serves: this writer stores
                        # it (its step's other ranks wait on it). A save() waits for one.
                        in_process=step is not None,
                    ).task_id
                    # A writer adopting the save follows this request instead of a new one.
                    durable.replace_file(sidecar, request.encode())
                out = wait_store(StoreRequest(request, name, staged))
                v = connected_metadata().versions.version(out["vkey"])
                saved = SavedVersion(name, v["version_id"], bool(out["new"]), int(v["size"]))
                if step is None:
                    return saved
                continue  # record the part in its step, retried as the rest
            except ShardedCheckpointError:
                raise  # the step refuses this part: no retry mends it
            except (SmoltorrentError, RedisError, OSError) as exc:
                if request is not None and not isinstance(exc, (RedisError, MetadataError)):
                    raise  # submitted, and the store itself ended badly: no retry mends it
                if str(exc) != last_error:
                    log.warning("%s not stored yet, retrying: %s", name, exc)
                    last_error = str(exc)
                if time.monotonic() > deadline:
                    raise _Pending(
                        f"{name} is not stored: {exc} The snapshot is kept at {staged} and "
                        "journalled; the next save or load on this machine stores it once "
                        "the cause is fixed."
                    ) from None
                time.sleep(defaults.SAVE_RETRY_S)

    def finish(
        self, path: str, fd: int, record: dict[str, Any], outcome: Any, *, keep_record: bool
    ) -> None:
        if isinstance(outcome, BaseException):
            error = str(outcome)
            if isinstance(outcome, ShardedCheckpointError):
                # The step refused the part (another world size, a step done): storing the
                # staged file would not mend that, so it goes.
                Path(record["staged"]).unlink(missing_ok=True)
            elif not isinstance(outcome, (Lost, _Pending)):
                error += (
                    f" The state is kept at {record['staged']}: `smoltorrent store "
                    f"{record['staged']} --name {record['name']}` stores it once the cause "
                    "is fixed."
                )
            log.error("%s", error)
            if record.get("step") and not isinstance(outcome, (ShardedCheckpointError, _Pending)):
                _fail(record["step"], error)  # the other ranks stop waiting for this part
            message = {
                "id": record["id"],
                "ok": False,
                "error": error,
                "type": type(outcome).__name__,  # the trainer raises the same class
            }
        else:
            kept = self.keep_local(record, outcome)
            log.info(
                "%s stored as %s%s",
                record["name"],
                outcome.version_id[:12],
                ", kept in the local tier" if kept else "",
            )
            message = {
                "id": record["id"],
                "ok": True,
                "version_id": outcome.version_id,
                "new": outcome.new,
                "size": outcome.size,
            }
        if not keep_record:
            Path(path).unlink(missing_ok=True)
            Path(_request_path(path)).unlink(missing_ok=True)
        os.close(fd)
        with self.lock:
            self.held.discard(path)
            self.lock.notify_all()
        self.report(message)

    def keep_local(self, record: dict[str, Any], saved: Any) -> bool:
        """The committed save's staged file into the local tier, or deleted: never an error
        for the save, which is stored."""
        staged = Path(record["staged"])
        try:
            if local_tier.keep(
                self.staging,
                record["name"],
                saved.version_id,
                staged,
                config.local_keep(),
                config.local_tier_bytes(),
            ):
                return True
        except (OSError, SmoltorrentError) as exc:
            log.warning("%s not kept in the local tier: %s", record["name"], exc)
        staged.unlink(missing_ok=True)
        return False

    def report(self, message: dict[str, Any]) -> None:
        with self.out_lock:
            try:
                self.out.write(json.dumps(message) + "\n")
                self.out.flush()
            except (BrokenPipeError, ValueError):  # the trainer is gone: the store is not
                self.out = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)


class _Pending(SmoltorrentError):
    """Not submitted within SAVE_PATIENCE_S; the record stays for the next writer."""


def _beat(step: dict[str, Any], done: threading.Event) -> None:
    """Heartbeats of a rank's part while its store runs; a beat Redis misses is the next
    one's to make (the part counts as abandoned only after STEP_STALE_S of silence)."""
    from smoltorrent.sharded import beat_part

    while not done.wait(defaults.STEP_BEAT_S):
        try:
            beat_part(step)
        except Exception as exc:  # noqa: BLE001 (Redis away: the store rides it out)
            log.debug("heartbeat of %s missed: %s", step, exc)


def _fail(step: dict[str, Any], error: str) -> None:
    """Record the part's failure in its step, if Redis answers; if not, its beat going
    stale says the same, later."""
    from smoltorrent.sharded import fail_part

    try:
        fail_part(step, error)
    except Exception as exc:  # noqa: BLE001
        log.warning("the failure of %s's part is not recorded in its step: %s", step, exc)


def _serialize(snapshot: str, layout: list[list[Any]], header: dict | None, out: str) -> None:
    """The safetensors file of the snapshot, by safetensors' own serializer reading the
    shared pages in place: the same bytes its torch and numpy writers write."""
    from safetensors import TensorSpec, serialize_file

    size = max((off + n for _, _, _, off, n in layout), default=0)
    with open(snapshot, "r+b") as f:
        mm = mmap.mmap(f.fileno(), size) if size else None
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm)) if mm is not None else 0
        specs = {
            name: TensorSpec(dtype=dtype, shape=shape, data_ptr=base + off if n else 0, data_len=n)
            for name, dtype, shape, off, n in layout
        }
        serialize_file(specs, out, metadata=header)
    finally:
        if mm is not None:
            del base
            mm.close()


def _request_path(record: str) -> str:
    """Beside the record, not in it: rewriting the record would make a new file, and the
    locks that say who holds the save are on the old one."""
    return record.removesuffix(".json") + ".request"


def _nice() -> int:
    """SMOLTORRENT_WRITER_NICE; a bad value is logged, not fatal: a writer that exits at
    start would be started again by its trainer, save after save."""
    try:
        return config.writer_nice()
    except ConfigError as exc:
        log.warning("%s; running at nice %d", exc, defaults.WRITER_NICE)
        return defaults.WRITER_NICE


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s writer[{os.getpid()}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # Below the trainer before any thread starts (each inherits it): the staged file and
    # the store's follow-up are background work, and a core they take is a step's.
    priority.lower(_nice())
    writer = Writer(Path(argv[1]))
    writer.journal.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=writer.read_trainer, daemon=True).start()
    writer.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
