"""The local tier: a machine's last saves kept beside the trainer, read first by load.

Once a save's version is committed, the writer process (smoltorrent/snapshot_writer.py)
moves its staged file, already fsync'd, to STAGING/local/VKEY.safetensors (VKEY: the
version's storage key, so one name's versions and equal bytes under two names stay
apart) and fsyncs the directory, instead of deleting it. The newest files are kept, at
most config.local_keep() of them and config.local_tier_bytes() bytes together; older
ones are deleted as a new one comes in, and a file larger than the whole budget is not
kept at all.

load reads a kept copy only once every byte is checked against the version's manifest
in Redis, the same digests the cluster's copies answer to: the header bytes verbatim,
each shard's blob SHA-256 over its blob header and its range of the file (a chunked
version: each chunk's raw SHA-256), the ranges covering the data section end to end. A
copy that fails is deleted and the load reads from the cluster. The copy is read through
a hard link of its own, so a save evicting it meanwhile does not pull it from under the
load.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coordinator.dataplane.store_engine import hash_blob
from coordinator.plan.blob_spans import blob_spans
from coordinator.plan.manifest import Manifest, source_prefix
from coordinator.plan.version_ids import storage_key
from smoltorrent import defaults, durable

log = logging.getLogger("smoltorrent.local_tier")

SUFFIX = ".safetensors"


def tier_dir(staging: Path) -> Path:
    return staging / "local"


def keep(
    staging: Path, name: str, version_id: str, staged: Path, count: int, max_bytes: int
) -> bool:
    """Move a committed save's staged file into the tier and evict past the bounds; False
    (the caller deletes the file) when the tier is off or the file exceeds the budget."""
    size = staged.stat().st_size
    if count < 1 or size > max_bytes:
        return False
    directory = tier_dir(staging)
    directory.mkdir(exist_ok=True)
    final = directory / f"{storage_key(name, version_id)}{SUFFIX}"
    os.replace(staged, final)
    now = time.time_ns()
    os.utime(final, ns=(now, now))  # its place in the order: the newest, whatever its age
    durable.sync_path(directory)
    durable.sync_path(staged.parent)
    evict(directory, count, max_bytes)
    return True


def evict(directory: Path, count: int, max_bytes: int) -> list[Path]:
    """Delete all but the newest files that fit within `count` files and `max_bytes`
    bytes; the first that does not fit goes, and every older one with it."""
    entries = []
    for path in directory.glob(f"*{SUFFIX}"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # evicted by another writer meanwhile
        entries.append((st.st_mtime_ns, path.name, path, st.st_size))
    entries.sort(reverse=True)
    kept_files = kept_bytes = 0
    removed = []
    for _, _, path, size in entries:
        if not removed and kept_files < count and kept_bytes + size <= max_bytes:
            kept_files += 1
            kept_bytes += size
        else:
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        durable.sync_path(directory)
    return removed


def link_verified(staging: Path, manifest: Manifest, into: Path) -> str | None:
    """Hard-link the kept copy of `manifest`'s version to `into` once every byte of it
    matches the manifest. None on success, else why not (no copy, or what differs: a
    copy that differs is deleted from the tier)."""
    kept = tier_dir(staging) / f"{manifest.storage_key()}{SUFFIX}"
    try:
        os.link(kept, into)
    except FileNotFoundError:
        return "no local copy"
    problem = _difference(into, manifest)
    if problem is None:
        return None
    log.warning(
        "local copy of %s is bad (%s); deleting it, reading from the cluster",
        manifest.name,
        problem,
    )
    try:
        if os.stat(kept).st_ino == os.stat(into).st_ino:  # not a fresh copy kept meanwhile
            kept.unlink()
    except FileNotFoundError:
        pass
    into.unlink(missing_ok=True)
    return problem


def _difference(path: Path, manifest: Manifest) -> str | None:
    """What in the file at `path` differs from the manifest, or None if nothing does."""
    size = path.stat().st_size
    if size != manifest.source_size:
        return f"{size} bytes, the version has {manifest.source_size}"
    prefix = source_prefix(manifest)
    with open(path, "rb") as f:
        if f.read(len(prefix)) != prefix:
            return "its header differs from the version's"
    if manifest.chunked:
        ranges = [
            (
                c.index,
                b"",
                manifest.data_start + c.data_start,
                c.data_end - c.data_start,
                c.raw_sha256,
            )
            for c in manifest.chunks
        ]
    else:
        ranges = [(s.index, s.prefix, s.offset, s.length, s.digest) for s in blob_spans(manifest)]
    at = manifest.data_start
    for _, _, offset, length, _ in sorted(ranges, key=lambda r: r[2]):
        if offset != at:
            return f"the manifest leaves bytes {at}..{offset} unchecked"
        at = offset + length
    if at != size:
        return f"the manifest leaves bytes {at}..{size} unchecked"
    with ThreadPoolExecutor(defaults.LOCAL_VERIFY_THREADS) as pool:
        digests = list(pool.map(lambda r: hash_blob(str(path), *r[:4]), ranges))
    for (index, _, _, _, expected), got in zip(ranges, digests, strict=True):
        if got != expected:
            return f"{'chunk' if manifest.chunked else 'shard'} {index} has other bytes"
    return None
