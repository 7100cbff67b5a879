"""A node's data directory: content-addressed blobs, manifests and the node's stable id.

Layout under the data dir:
    node_id                 uuid4 hex, generated once and kept forever
    blobs/<2 hex>/<64 hex>  complete, verified blobs named by their SHA-256 (all 256
                            buckets made when the store opens)
    tmp/                    incoming data; anything here at start is a crash leftover
    manifests/<key>.json    manifests, as the coordinator sent them
    quarantine/<64 hex>     copies that hashed wrong at rest: out of every read, kept until
                            the coordinator knows a good copy exists (then `discard`)

Only validated digests and manifest keys ever become path components, and a
blob becomes visible only after it was hashed, fsynced and renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from smoltorrent import defaults, durable
from smoltorrent.errors import (
    DigestMismatchError,
    DiskFullError,
    DiskIOError,
    NotFoundError,
    ProtocolError,
    SmoltorrentError,
)
from worker_server import protocol, writeback

log = logging.getLogger(__name__)

NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

# Fan-out buckets under blobs/, one per first byte of the digest (its first 2 hex digits).
BUCKETS = 16**2


def write_file_atomically(path: Path, data: bytes, tmp_dir: Path) -> None:
    """Write data to path so readers see the old file or the new one, never a mix."""
    try:
        durable.replace_file(path, data, tmp_dir)
    except OSError as exc:
        raise _disk_error(exc, f"write {path.name}") from exc


def _disk_error(exc: OSError, what: str) -> DiskFullError | DiskIOError:
    """A failed write, fsync or rename as the answer it is (disk_full, disk_error): an
    OSError left as it is drops the connection, which the sender reads as a dead node."""
    if exc.errno in NO_SPACE_ERRNOS:
        return DiskFullError(f"no space left to {what}: free some disk space")
    return DiskIOError(f"this node's disk failed to {what} ({exc}): check the disk (dmesg, SMART)")


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def unlink_durably(path: Path) -> bool:
    """Remove a file and fsync its directory; False if it was not there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    try:
        durable.sync_path(path.parent)
    except OSError as exc:
        # Gone from the directory, maybe not from the disk: a retry finds it gone.
        raise _disk_error(exc, f"delete {path.name}") from exc
    return True


class BlobStore:
    """The blobs and manifests of one node, rooted at its data directory."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.root = Path(data_dir)
        self.blobs_dir = self.root / "blobs"
        self.tmp_dir = self.root / "tmp"
        self.manifests_dir = self.root / "manifests"
        self.quarantine_dir = self.root / "quarantine"
        for directory in (
            self.root,
            self.blobs_dir,
            self.tmp_dir,
            self.manifests_dir,
            self.quarantine_dir,
        ):
            directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock_data_dir()
        self._make_buckets()
        # Puts in flight, each holding the space it has yet to write: the disk has room
        # for a new put only beyond what they still need (statvfs sees only what is written).
        self._incoming: set[IncomingBlob] = set()
        self._incoming_lock = threading.Lock()
        self._remove_stale_tmp_files()
        self.node_id = self._load_or_create_node_id()

    def _lock_data_dir(self) -> int:
        # Two nodes on one directory would delete each other's incoming files at start.
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SmoltorrentError(
                f"another smoltorrent node is already serving {self.root}:"
                " stop it first, or give this one its own --data-dir"
            ) from None
        return fd

    def close(self) -> None:
        """Release the data directory for another node process."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _make_buckets(self) -> None:
        # Every fan-out bucket made once, here, with one fsync of blobs/ for all: else a
        # put into a new bucket pays a mkdir and that fsync, and on a fresh node nearly
        # every blob of a first store lands in a new bucket (~141 blobs a node per GB
        # over 256 buckets). _publish still makes a bucket removed by hand.
        made = False
        for first in range(BUCKETS):
            try:
                (self.blobs_dir / f"{first:02x}").mkdir()
                made = True
            except FileExistsError:
                pass
        if made:
            durable.sync_path(self.blobs_dir)

    def _remove_stale_tmp_files(self) -> None:
        # Nothing else runs yet, so whatever is here was left by a crash mid-transfer.
        for leftover in self.tmp_dir.iterdir():
            log.info("removing %s, left over from an interrupted transfer", leftover)
            _unlink_quietly(leftover)

    def _load_or_create_node_id(self) -> str:
        path = self.root / "node_id"
        try:
            node_id = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            node_id = uuid.uuid4().hex
            write_file_atomically(path, node_id.encode("ascii") + b"\n", self.tmp_dir)
            log.info("new node id %s written to %s", node_id, path)
            return node_id
        except UnicodeDecodeError:
            node_id = ""
        if len(node_id) != protocol.NODE_ID_CHARS or not protocol.HEX_PATTERN.fullmatch(node_id):
            raise SmoltorrentError(
                f"{path} does not hold a node id (32 hex digits): restore it from a backup,"
                " or move the data directory aside to start this node afresh"
            )
        return node_id

    def blob_path(self, digest: str) -> Path:
        digest = protocol.validate_digest(digest)
        return self.blobs_dir / digest[:2] / digest

    def has(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def present(self, digests: list[str]) -> list[str]:
        """The digests among `digests` held as complete blobs, in the order given."""
        return [digest for digest in digests if self.has(digest)]

    def inventory(self) -> dict[str, int]:
        """Every complete blob: digest -> size in bytes."""
        sizes: dict[str, int] = {}
        for bucket in self.blobs_dir.iterdir():
            if not bucket.is_dir():
                continue
            for entry in os.scandir(bucket):
                if self._is_blob_entry(entry, bucket.name):
                    sizes[entry.name] = entry.stat().st_size
        return sizes

    def inventory_page(self, after: str | None, limit: int) -> tuple[dict[str, int], bool]:
        """At most `limit` complete blobs whose digests sort after `after` (from the first if
        None), in digest order: digest -> size; and whether more follow. A page reads only
        the buckets from `after`'s on, so listing a node in pages reads each bucket about once."""
        sizes: dict[str, int] = {}
        buckets = sorted(b.name for b in self.blobs_dir.iterdir() if b.is_dir())
        for name in buckets:
            if after is not None and name < after[:2]:
                continue
            held = sorted(
                (entry.name, entry)
                for entry in os.scandir(self.blobs_dir / name)
                if (after is None or entry.name > after) and self._is_blob_entry(entry, name)
            )
            for digest, entry in held:
                if len(sizes) == limit:
                    return sizes, True
                sizes[digest] = entry.stat().st_size
        return sizes, False

    @staticmethod
    def _is_blob_entry(entry: os.DirEntry[str], bucket_name: str) -> bool:
        name = entry.name
        return (
            len(name) == protocol.DIGEST_CHARS
            and name[:2] == bucket_name
            and protocol.HEX_PATTERN.fullmatch(name) is not None
            and entry.is_file()
        )

    def open_blob(self, digest: str) -> tuple[int, int]:
        """(read-only fd, size) of a blob; the caller closes the fd."""
        try:
            fd = os.open(self.blob_path(digest), os.O_RDONLY)
        except FileNotFoundError:
            raise NotFoundError(f"this node holds no blob {digest}") from None
        return fd, os.fstat(fd).st_size

    def free_bytes(self) -> int:
        """Free space on the data directory's disk, less what the puts in flight still
        have to write (reserved for them)."""
        with self._incoming_lock:
            return self._free_unreserved()

    def _free_unreserved(self) -> int:
        usage = os.statvfs(self.root)
        reserved = sum(incoming.still_to_write for incoming in self._incoming)
        return usage.f_bavail * usage.f_frsize - reserved

    def begin_put(self, digest: str, size: int) -> IncomingBlob:
        """A temp file to stream a blob into, its `size` bytes reserved until it is
        published or aborted (a session that times out aborts it); DiskFullError if it
        cannot fit beside the puts already in flight."""
        digest = protocol.validate_digest(digest)
        with self._incoming_lock:
            free = self._free_unreserved()
            if free < size:
                raise DiskFullError(
                    f"blob {digest[:12]} needs {size} bytes but only {max(free, 0)} are free"
                    " on this node (beside the transfers in flight): free space here or place"
                    " the shard on another node"
                )
            fd, tmp_name = tempfile.mkstemp(
                dir=self.tmp_dir, prefix=digest[:16] + ".", suffix=".part"
            )
            incoming = IncomingBlob(self, digest, size, fd, Path(tmp_name))
            self._incoming.add(incoming)
        return incoming

    def _release(self, incoming: IncomingBlob) -> None:
        with self._incoming_lock:
            self._incoming.discard(incoming)

    def _publish(self, tmp_path: Path, digest: str) -> None:
        target = self.blob_path(digest)
        try:
            os.replace(tmp_path, target)
        except FileNotFoundError:
            # The buckets are made when the store opens; this is for one removed since.
            # Tried after the rename, not before it: a mkdir per blob that fails with
            # EEXIST cost every put a system call and a Python exception.
            with contextlib.suppress(FileExistsError):
                target.parent.mkdir()
            durable.sync_path(self.blobs_dir)
            os.replace(tmp_path, target)
        durable.sync_path(target.parent)
        if self.discard_quarantined(digest):
            log.info("blob %s is whole here again: its quarantined copy is deleted", digest)

    def delete(self, digest: str) -> bool:
        return unlink_durably(self.blob_path(digest))

    def verify(self, digests: list[str] | None = None) -> list[str]:
        """Re-hash blobs (all if None); the digests that are missing or hash to something else.
        A copy that hashes to something else is quarantined."""
        targets = sorted(self.inventory()) if digests is None else digests
        buffer = bytearray(defaults.IO_CHUNK_BYTES)
        return [digest for digest in targets if not self._verify_one(digest, buffer)]

    def verified_size(
        self, digest: str, progress: Callable[[int], None] | None = None
    ) -> int | None:
        """The size of this node's copy of `digest` if its bytes hash to its name (the copy
        is whole), else None (damaged, or gone).

        A put answers "exists" only after this, at the size it announced. A blob counted as
        a replica must be one now, not when it was written: a copy that rotted or that
        something appended to since would make a version commit with fewer good copies than
        it promises. The re-hash reads the node's own disk, cheaper than the network send
        it saves, and progress(bytes hashed) lets the caller report that the node is still
        working.
        """
        try:
            size = self.blob_path(digest).stat().st_size
        except FileNotFoundError:
            return None
        buffer = bytearray(defaults.IO_CHUNK_BYTES)
        return size if self._hash_file(digest, buffer, progress) == digest else None

    def _hash_file(
        self, digest: str, buffer: bytearray, progress: Callable[[int], None] | None = None
    ) -> str | None:
        hasher = hashlib.sha256()
        view = memoryview(buffer)
        done = 0
        try:
            with open(self.blob_path(digest), "rb", buffering=0) as blob:
                while count := blob.readinto(view):
                    hasher.update(view[:count])
                    done += count
                    if progress is not None:
                        progress(done)
        except FileNotFoundError:
            return None
        return hasher.hexdigest()

    def _verify_one(self, digest: str, buffer: bytearray) -> bool:
        try:
            inode = self.blob_path(digest).stat().st_ino
        except FileNotFoundError:
            return False
        if self._hash_file(digest, buffer) == digest:
            return True
        self.quarantine(digest, inode=inode)  # a no-op if a good copy replaced it meanwhile
        return False

    def quarantine(self, digest: str, *, inode: int) -> bool:
        """Move a bad copy out of blobs/ into quarantine/; False if the file at its path is
        no longer the inode that was hashed (deleted, or replaced by a good copy meanwhile)."""
        path = self.blob_path(digest)
        try:
            if os.stat(path).st_ino != inode:
                return False
            os.replace(path, self.quarantine_dir / digest)
            durable.sync_path(self.quarantine_dir)
            durable.sync_path(path.parent)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _disk_error(exc, f"quarantine blob {digest[:12]}") from exc
        return True

    def quarantined(self) -> list[str]:
        """Digests of the bad copies held in quarantine, sorted."""
        return sorted(
            entry.name
            for entry in os.scandir(self.quarantine_dir)
            if len(entry.name) == protocol.DIGEST_CHARS
            and protocol.HEX_PATTERN.fullmatch(entry.name)
        )

    def discard_quarantined(self, digest: str) -> bool:
        """Delete a quarantined copy; False if there was none."""
        return unlink_durably(self.quarantine_dir / protocol.validate_digest(digest))

    def stat(self) -> dict[str, Any]:
        usage = os.statvfs(self.root)
        sizes = self.inventory()
        return {
            "node_id": self.node_id,
            # What placement may count on: the space puts in flight will take is not free.
            "free_bytes": max(self.free_bytes(), 0),
            "total_bytes": usage.f_blocks * usage.f_frsize,
            "used_bytes": sum(sizes.values()),
            "blob_count": len(sizes),
            # Bad copies held: the coordinator's health probe sees a new one at once.
            "quarantined": len(self.quarantined()),
            # Where it keeps them: `smoltorrent up` starts a node of its own host again from
            # here (same id, same address), not a new one at its address.
            "data_dir": str(self.root.resolve()),
        }

    def _manifest_path(self, key: str) -> Path:
        return self.manifests_dir / (protocol.validate_key(key) + ".json")

    def put_manifest(self, key: str, data: bytes) -> None:
        write_file_atomically(self._manifest_path(key), data, self.tmp_dir)

    def list_manifests(self) -> list[str]:
        keys = []
        for path in self.manifests_dir.glob("*.json"):
            if protocol.KEY_PATTERN.fullmatch(path.stem):
                keys.append(path.stem)
        return sorted(keys)

    def delete_manifest(self, key: str) -> bool:
        return unlink_durably(self._manifest_path(key))

    def put_manifest_part(self, key: str, offset: int, total: int, data: bytes) -> None:
        """Write one part of a manifest sent in parts, in order: the first (offset 0) starts
        it afresh in tmp/, each next one must start where the last ended, and the one that
        completes it publishes it like put_manifest (fsynced, renamed into place)."""
        partial = self.tmp_dir / (protocol.validate_key(key) + ".manifest-parts")
        try:
            with open(partial, "wb" if offset == 0 else "r+b") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() != offset:
                    raise ProtocolError(
                        f"manifest {key!r} part at {offset}, but {f.tell()} bytes arrived so far:"
                        " send its parts in order, from offset 0"
                    )
                f.write(data)
                if offset + len(data) < total:
                    return
                f.flush()
                durable.sync(f.fileno())
            os.replace(partial, self._manifest_path(key))
            durable.sync_path(self.manifests_dir)
        except FileNotFoundError:
            raise ProtocolError(
                f"manifest {key!r} part at {offset} before its first part: start from offset 0"
            ) from None
        except OSError as exc:
            _unlink_quietly(partial)
            raise _disk_error(exc, f"write manifest {key!r}") from exc

    def get_manifest_range(self, key: str, offset: int, length: int) -> tuple[int, bytes]:
        """(the manifest's size, at most `length` of its bytes from `offset`)."""
        try:
            with open(self._manifest_path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(offset)
                return size, f.read(length)
        except FileNotFoundError:
            raise NotFoundError(f"this node holds no manifest {key!r}") from None

    def get_manifest(self, key: str) -> bytes:
        try:
            return self._manifest_path(key).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"this node holds no manifest {key!r}") from None


class IncomingBlob:
    """A blob being received: hashed as it is written to a temp file, published on commit.

    Used as a context manager, it always leaves tmp/ clean: published or removed.
    """

    def __init__(self, store: BlobStore, digest: str, size: int, fd: int, tmp_path: Path):
        self._store = store
        self.digest = digest
        self.size = size
        self._fd = fd
        self._tmp_path = tmp_path
        self._hasher = hashlib.sha256()
        self._written = 0
        self._write_error: OSError | None = None
        # The disk writes while the rest arrives: the fsync in commit() finds little left.
        self._writeback = writeback.Trail(fd)

    def write(self, chunk: memoryview) -> None:
        """Hash and append a chunk; after a write error, keep accepting (and dropping) bytes so
        the sender can finish and read our answer."""
        if self._write_error is not None:
            return
        self._hasher.update(chunk)
        try:
            while chunk:
                # pwrite at the offset, not write: the same bytes, and a disk fault injected
                # on pwrite (libfiu, tests and chaos runs) cannot hit the node's sockets.
                written = os.pwrite(self._fd, chunk, self._written)
                chunk = chunk[written:]
                self._written += written
            self._writeback.wrote(self._written)
        except OSError as exc:
            self._write_error = exc
            self.abort()

    def commit(self) -> None:
        """Check size and digest, fsync, rename into place, fsync the directory."""
        try:
            if self._write_error is not None:
                raise self._write_error
            digest = self._hasher.hexdigest()
            if self._written != self.size or digest != self.digest:
                raise DigestMismatchError(
                    f"received {self._written} bytes hashing to {digest}, not the {self.size}"
                    f" bytes of blob {self.digest} that were announced; send it again"
                )
            durable.sync(self._fd)
            os.close(self._fd)
            self._fd = -1
            self._store._publish(self._tmp_path, self.digest)
        except OSError as exc:
            self.abort()
            if exc.errno in NO_SPACE_ERRNOS:
                raise DiskFullError(
                    f"this node ran out of disk space while storing blob {self.digest[:12]}:"
                    " free space here or place the shard on another node"
                ) from exc
            # Said as an answer, not a dropped connection: the sender places the copy
            # elsewhere and the operator learns which disk to check.
            raise DiskIOError(
                f"this node's disk failed while storing blob {self.digest[:12]} ({exc}):"
                " check the disk (dmesg, SMART); the copy can go to another node"
            ) from exc
        except BaseException:
            self.abort()
            raise

    @property
    def still_to_write(self) -> int:
        """Bytes of the announced size not yet on disk: what this put keeps reserved."""
        return max(self.size - self._written, 0)

    def abort(self) -> None:
        """Close and remove the temp file (a published blob was renamed away already) and
        release its reservation; safe to call more than once."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        _unlink_quietly(self._tmp_path)
        self._store._release(self)

    def __enter__(self) -> IncomingBlob:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.abort()
