"""checksum_sync on the node: re-hash every blob at a bounded rate and quarantine bad copies.

A pass walks the blobs in digest order from a cursor kept in the data dir
(`scrub_cursor`), so a node restarted mid-pass resumes where it stopped
instead of re-reading an SD card from the start. Reads are paced so the pass
never averages more than `rate_bps` bytes per second: scrubbing must not
starve the gathers the card also serves. A copy that hashes to something else
is moved to quarantine/ (out of every read, kept until the coordinator says a
good copy exists) and counted; the coordinator learns of it from `scrub`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from typing import Any

from smoltorrent import defaults
from worker_server.blob_store import BlobStore, write_file_atomically
from worker_server.metrics import NodeMetrics

log = logging.getLogger(__name__)

CURSOR_FILE = "scrub_cursor"  # in the data dir: JSON {"after": digest of the last blob done}


class Scrubber:
    """One node's scrub passes: at most one runs at a time, in a daemon thread."""

    def __init__(self, store: BlobStore, rate_bps: int, metrics: NodeMetrics) -> None:
        self.store = store
        self.rate_bps = rate_bps
        self.metrics = metrics
        self._cursor_path = store.root / CURSOR_FILE
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.scrubbed_bytes = 0  # since this process started, all passes together
        self.passes = 0  # passes finished since this process started
        self.last_pass_finished: float | None = None  # wall-clock time, seconds
        self.found_bad = 0  # bad copies quarantined since this process started

    def request_pass(self) -> dict[str, Any]:
        """Start a pass from the saved cursor unless one is running; the scrub status."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run_pass, name="scrub", daemon=True)
                self._thread.start()
        return self.status()

    def status(self) -> dict[str, Any]:
        running = self._thread is not None and self._thread.is_alive()
        return {
            "running": running,
            "after": self._load_cursor(),
            "rate_bps": self.rate_bps,
            "scrubbed_bytes": self.scrubbed_bytes,
            "passes": self.passes,
            "last_pass_finished": self.last_pass_finished,
            "found_bad": self.found_bad,
            "quarantined": self.store.quarantined(),
        }

    def stop(self) -> None:
        """End a running pass at its next chunk; its cursor stays for the next one."""
        self._stopping.set()
        thread = self._thread
        if thread is not None:
            thread.join(defaults.SHUTDOWN_GRACE_S)

    def _load_cursor(self) -> str:
        try:
            after = json.loads(self._cursor_path.read_bytes()).get("after", "")
        except (FileNotFoundError, ValueError, AttributeError):
            return ""
        return after if isinstance(after, str) else ""

    def _save_cursor(self, after: str) -> None:
        data = json.dumps({"after": after}).encode("ascii")
        write_file_atomically(self._cursor_path, data, self.store.tmp_dir)

    def _run_pass(self) -> None:
        try:
            self._scrub_from(self._load_cursor())
        except Exception:
            log.exception("scrub pass failed; the next scrub request resumes from the cursor")

    def _scrub_from(self, after: str) -> None:
        todo = sorted(digest for digest in self.store.inventory() if digest > after)
        log.info("scrub pass: %d blobs to re-hash at %d bytes/s", len(todo), self.rate_bps)
        pacer = _Pacer(self.rate_bps, self._stopping)
        buffer = bytearray(defaults.SCRUB_CHUNK_BYTES)
        saved_at = time.monotonic()
        for digest in todo:
            self._check(digest, buffer, pacer)
            if self._stopping.is_set():
                # A blob cut off mid-read is re-hashed by the next pass: the cursor stays
                # before it, and an unfinished pass never counts as a finished one.
                self._save_cursor(after)
                log.info("scrub pass stopped; the next one resumes after %s", after or "the start")
                return
            after = digest
            if time.monotonic() - saved_at >= defaults.SCRUB_CURSOR_SAVE_S:
                self._save_cursor(after)
                saved_at = time.monotonic()
        self._save_cursor("")
        self.passes += 1
        self.last_pass_finished = time.time()
        log.info("scrub pass finished (%d bad copies found so far)", self.found_bad)

    def _check(self, digest: str, buffer: bytearray, pacer: _Pacer) -> None:
        hasher = hashlib.sha256()
        view = memoryview(buffer)
        try:
            fd = os.open(self.store.blob_path(digest), os.O_RDONLY)
        except FileNotFoundError:
            return  # deleted since the listing: nothing to check
        try:
            while not self._stopping.is_set() and (count := os.readv(fd, [view])):
                hasher.update(view[:count])
                self.scrubbed_bytes += count
                self.metrics.scrubbed(count)
                pacer.consumed(count)
            if self._stopping.is_set() or hasher.hexdigest() == digest:
                return
            if self.store.quarantine(digest, inode=os.fstat(fd).st_ino):
                self.found_bad += 1
                self.metrics.verify_failed("at_rest")
                log.error(
                    "blob %s hashes to %s on this disk: quarantined until the coordinator"
                    " repairs it from another copy",
                    digest,
                    hasher.hexdigest(),
                )
        finally:
            os.close(fd)


class _Pacer:
    """Sleeps so that bytes consumed since the start never run ahead of rate_bps; a stop
    request ends the sleep (at a low rate one chunk's wait can be hours)."""

    def __init__(self, rate_bps: int, stopping: threading.Event) -> None:
        self.rate_bps = rate_bps
        self.stopping = stopping
        self.started = time.monotonic()
        self.total = 0

    def consumed(self, count: int) -> None:
        self.total += count
        ahead = self.started + self.total / self.rate_bps - time.monotonic()
        if ahead > 0:
            self.stopping.wait(ahead)
