"""Gather: rebuild a checkpoint byte for byte from its shards.

A temp file beside the destination is preallocated to the source size, the
original header is written at offset 0, and every shard's data range is
pulled in parallel straight to its offset (pwrite), hashed as it arrives
together with the blob's own header, over connections kept from one shard or
chunk to the next. A copy whose length is not the
manifest's blob size is refused before any of it is written, and no write
leaves the shard's range, so a bad copy can only dirty bytes its own
fallback rewrites. A failure or a digest mismatch moves to the next
replica; a copy that proved corrupt is listed in the report's bad_copies.
Only a complete, verified file of the source's size is fsynced and renamed
onto the destination; on failure the temp file is removed and an existing
destination is untouched.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from coordinator.dataplane.chunk_engine import gather_chunks
from coordinator.dataplane.node_client import KeptConnections, NodeClient
from coordinator.dataplane.replicas import BadCopy, Unanswered, first_intact, keeping
from coordinator.dataplane.staged_output import staged_output
from coordinator.plan.manifest import Manifest, source_prefix
from smoltorrent import defaults
from smoltorrent.errors import DestinationNotAllowedError, GatherError, SmoltorrentError

Progress = Callable[[int], None]


@dataclass
class GatherReport:
    path: str
    size: int
    served_by: dict[int, str] = field(default_factory=dict)  # shard or chunk -> node address
    fallbacks: list[str] = field(default_factory=list)  # one line per replica that failed
    bad_copies: list[BadCopy] = field(default_factory=list)  # copies that proved corrupt


def check_destination(out_path: str | os.PathLike, allowed: Sequence[os.PathLike]) -> str:
    """out_path, absolute, if its directory lies under one of `allowed` (symlinks
    resolved); DestinationNotAllowedError otherwise."""
    out = os.path.abspath(os.fspath(out_path))
    directory = os.path.realpath(os.path.dirname(out))
    for root in allowed:
        real_root = os.path.realpath(root)
        if os.path.commonpath([directory, real_root]) == real_root:
            return out
    shown = ", ".join(os.fspath(root) for root in allowed) or "nowhere"
    raise DestinationNotAllowedError(
        f"refusing to write {out}: gathers sent to this worker write only under {shown}."
        " Choose an output there, list more directories in SMOLTORRENT_GATHER_DIRS"
        f" (separated by {os.pathsep!r}) for the worker, or run the gather on its machine"
        " with `smoltorrent gather`, which writes wherever its user can"
    )


def gather_checkpoint(
    manifest: Manifest,
    sources: Sequence[Sequence[NodeClient]],
    out_path: str | os.PathLike,
    *,
    threads: int = defaults.TRANSFER_THREADS,
    progress: Progress | None = None,
    on_bad_copy: Callable[[BadCopy], None] | None = None,
) -> GatherReport:
    """Write the checkpoint of `manifest` to out_path; sources[i] lists shard i's replicas
    in the order to try them. on_bad_copy(copy) runs for every corrupt copy met, whether
    the gather then succeeds or fails."""
    out_path = os.path.abspath(os.fspath(out_path))
    kind, count = (
        ("chunk", len(manifest.chunks)) if manifest.chunked else ("shard", len(manifest.shards))
    )
    if len(sources) != count:
        raise SmoltorrentError(
            f"gather of {manifest.name}: {len(sources)} replica lists for {count} {kind}s"
        )
    report = GatherReport(path=out_path, size=manifest.source_size)
    lock = threading.Lock()

    def bad_copy(bad: BadCopy) -> None:
        with lock:
            report.bad_copies.append(bad)
        if on_bad_copy:
            on_bad_copy(bad)

    # Each thread keeps its connection to a node from one shard or chunk to the next.
    kept = KeptConnections()
    sources = keeping(sources, kept)
    unanswered = Unanswered()
    with kept, staged_output(out_path, manifest.source_size, manifest.name) as fd:
        os.pwrite(fd, source_prefix(manifest), 0)

        def one_shard(index: int) -> str | None:
            shard = manifest.shards[index]

            def read(client: NodeClient) -> None:
                # the client hashes as bytes arrive and raises on a mismatch
                client.get_blob_to_file(
                    shard.blob_sha256,
                    fd,
                    manifest.data_start + shard.data_start,
                    size=shard.blob_size,
                    skip=shard.blob_data_offset,
                    progress=progress,
                )

            served_by, tried = first_intact(
                index, shard.blob_sha256, sources[index], read, bad_copy, unanswered
            )
            if served_by is not None:
                with lock:
                    report.served_by[index] = served_by
                    report.fallbacks.extend(f"shard {index} {line}" for line in tried)
                return None
            where = "; ".join(tried) or "no node holds a copy"
            tensors = _names(shard.tensors)
            return f"shard {index} ({shard.blob_sha256[:12]}, tensors {tensors}): {where}"

        if manifest.chunked:
            served, fallbacks, missing = gather_chunks(
                manifest,
                sources,
                fd,
                threads=threads,
                progress=progress,
                on_bad_copy=bad_copy,
                unanswered=unanswered,
            )
            report.served_by.update(served)
            report.fallbacks.extend(fallbacks)
        else:
            with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
                missing = [m for m in pool.map(one_shard, range(count)) if m]
        if missing:
            raise GatherError(
                f"cannot rebuild {manifest.name} (version {manifest.version_id[:12]}): "
                f"{len(missing)} of {count} {kind}s have no good replica: "
                + " | ".join(missing)
                + f". Nothing was written to {out_path}. Bring a node holding them back "
                "(`smoltorrent status`) and gather again."
            )
        written = os.fstat(fd).st_size
        if written != manifest.source_size:
            raise GatherError(
                f"the rebuilt {manifest.name} is {written} bytes, not the {manifest.source_size}"
                f" of its source; nothing was written to {out_path}. Gather again, and report"
                " this if it repeats."
            )
    return report


def _names(tensors: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(tensors[:limit])
    return shown + (f" and {len(tensors) - limit} more" if len(tensors) > limit else "")
