"""The gather itself: a version rebuilt into a file on this host, in whichever process
runs it: the gather task (tasks/gather.py) on a worker, or a reader's own process (the
CLI, `smoltorrent.load`: tasks/requests.py) where no worker takes it.

Imports no Celery: a reader's gather starts without it (a tenth of a second or more of
every `smoltorrent gather`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import redis

from coordinator import config
from coordinator.dataplane.bandwidth import WireMeter
from coordinator.dataplane.gather_engine import gather_checkpoint
from coordinator.dataplane.node_client import NodeClient
from coordinator.dataplane.partial_engine import gather_tensors
from coordinator.dataplane.replicas import BadCopy
from coordinator.plan.manifest import Manifest
from coordinator.plan.read_order import read_order
from coordinator.plan.selection import select
from coordinator.state.metadata import Metadata
from coordinator.state.nodes import NodeRecord
from coordinator.state.reader_mark import reading
from smoltorrent import defaults
from tasks.context import client, read_manifest


def run_gather(
    md: Metadata,
    vkey: str,
    out_path: str,
    tensors: list[str] | None,
    reader: str,
    on_progress: Callable[[int, int], None] | None = None,
    bwlimit: int | None = None,
) -> dict:
    """Rebuild version `vkey` into out_path (with `tensors`, only the tensors they select)
    in this process, whoever it is: the gather task, or a reader with no worker
    (tasks/requests.py). Its report, with the raw bytes written, the wire bytes received
    and their ratio. on_progress(done, total) at most every GATHER_PROGRESS_INTERVAL_S
    while bytes arrive; at most `bwlimit` bytes/s received (config.bwlimit_for)."""
    v = md.versions.version(vkey)
    what = f"{v['name']} version {v.get('version_id', vkey)[:12]}"
    meter = WireMeter.limited(config.bwlimit_for(bwlimit))
    # The reader mark keeps retention off this version until the file is complete.
    with reading(md, vkey, reader, what):
        if tensors is not None:
            report = _gather_tensors(md, vkey, out_path, tensors, meter)
        else:
            report = _gather(md, vkey, out_path, on_progress, meter)
    meter.raw(report["size"])
    return report | meter.totals.to_dict()


def _gather(
    md: Metadata,
    vkey: str,
    out_path: str,
    on_progress: Callable[[int, int], None] | None,
    meter: WireMeter,
) -> dict:
    """Pull every shard of `vkey` into out_path; the gather's report."""
    manifest = read_manifest(md, vkey)
    nodes = md.nodes.nodes()
    sources = _sources(md, manifest, nodes, meter)

    done = 0
    last = 0.0
    lock = threading.Lock()

    def progress(n: int) -> None:  # from the engine's threads, as bytes arrive
        nonlocal done, last
        with lock:
            done += n
            now = time.monotonic()
            if on_progress is not None and now - last >= defaults.GATHER_PROGRESS_INTERVAL_S:
                last = now
                on_progress(done, manifest.source_size)

    started = time.monotonic()
    report = gather_checkpoint(
        manifest, sources, out_path, progress=progress, on_bad_copy=bad_copy_recorder(md, nodes)
    )
    return {
        "path": report.path,
        "name": manifest.name,
        "version_id": manifest.version_id,
        "size": report.size,
        "seconds": round(time.monotonic() - started, 3),
        "served_by": {str(k): v for k, v in report.served_by.items()},
        "fallbacks": report.fallbacks,
        "bad_copies": [
            {"shard": b.shard, "node": b.address, "reason": b.reason} for b in report.bad_copies
        ],
        "host": config.host_id(),
    }


def _sources(
    md: Metadata, manifest: Manifest, nodes: dict[str, NodeRecord], meter: WireMeter
) -> list[list[NodeClient]]:
    """Per shard, clients of its holders in the order to try them (plan/read_order), each
    paced by the gather's meter. One client per node, and one list per order, shared by
    the shards read in that order (the engine only reads them): thousands of chunks over a
    handful of nodes, not a list and clients of their own each. A client reads the cluster
    key: read per holder of every chunk (an environment lookup and a file check each), it
    was 564 reads and ~30 ms before a 1 GB gather's first byte."""
    # Blobs on the same nodes share their placement, and so their holders: one tuple per
    # node set, not a list per chunk (in id order, as read_order breaks its ties).
    held: dict[frozenset[str], tuple[str, ...]] = {}
    holders = [
        held[p] if p in held else held.setdefault(p, tuple(sorted(n for n in p if n in nodes)))
        for p in md.blobs.placement_of([s.blob_sha256 for s in manifest.entries])
    ]
    orders = read_order(holders, [s.blob_size for s in manifest.entries], md.nodes.alive(nodes))
    clients = {
        n: client(nodes[n].address).paced(meter) for n in sorted({n for o in orders for n in o})
    }
    lists: dict[tuple[str, ...], list[NodeClient]] = {}
    for order in map(tuple, orders):
        if order not in lists:
            lists[order] = [clients[n] for n in order]
    return [lists[tuple(order)] for order in orders]


def _gather_tensors(
    md: Metadata, vkey: str, out_path: str, patterns: list[str], meter: WireMeter
) -> dict:
    """Only the tensors `patterns` select, their byte ranges read and verified one by one."""
    manifest = read_manifest(md, vkey)
    nodes = md.nodes.nodes()
    started = time.monotonic()
    selection = select(manifest, patterns)
    report = gather_tensors(
        manifest,
        selection,
        _sources(md, manifest, nodes, meter),
        out_path,
        on_bad_copy=bad_copy_recorder(md, nodes),
    )
    return {
        "path": report.path,
        "name": manifest.name,
        "version_id": manifest.version_id,
        "size": report.size,
        "seconds": round(time.monotonic() - started, 3),
        "tensors": report.tensors,
        "tensor_bytes": selection.data_bytes,
        "bytes_fetched": report.bytes_fetched,
        # Shards read whole because their manifest (schema 1) has no tensor digests.
        "whole_shards": report.whole_shards,
        # Of a chunked version: the chunks read (those holding a selected byte) of all.
        "chunks_read": report.chunks_read,
        "chunks_total": report.chunks_total,
        "fallbacks": report.fallbacks,
        "bad_copies": [
            {"shard": b.shard, "node": b.address, "reason": b.reason} for b in report.bad_copies
        ],
        "host": config.host_id(),
    }


def bad_copy_recorder(md: Metadata, nodes: dict[str, NodeRecord]) -> Callable[[BadCopy], None]:
    """Every copy a gather finds corrupt goes on record, and its check and repair are
    queued at once; the scrub sweep checks what is still on record (a send that failed)."""
    by_address = {str(n.address): node_id for node_id, n in nodes.items()}

    def record(bad: BadCopy) -> None:
        node_id = by_address.get(bad.address, bad.address)
        md.blobs.record_bad_copy(bad.digest, node_id, bad.reason)
        # Celery only now, a bad copy found: a gather in a reader's own process starts
        # without it. The gather goes on if the send fails: the record is the scrub
        # sweep's to check.
        from kombu.exceptions import OperationalError

        from tasks.enqueue import send_bad_copy

        with contextlib.suppress(redis.RedisError, OperationalError):
            send_bad_copy(bad.digest, node_id)

    return record
