"""The gather task: runs on the host that will hold the output file."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable

import redis
from kombu.exceptions import OperationalError

from coordinator import config
from coordinator.dataplane.bandwidth import WireMeter
from coordinator.dataplane.gather_engine import check_destination, gather_checkpoint
from coordinator.dataplane.node_client import NodeClient
from coordinator.dataplane.partial_engine import gather_tensors
from coordinator.dataplane.replicas import BadCopy
from coordinator.plan.manifest import Manifest
from coordinator.plan.read_order import read_order
from coordinator.plan.selection import select
from coordinator.state.metadata import Metadata
from coordinator.state.nodes import NodeRecord
from coordinator.state.reader_mark import reading
from coordinator.state.requests import DONE
from smoltorrent import defaults
from tasks import request_runs
from tasks.app import app
from tasks.context import client, metadata
from tasks.enqueue import send_bad_copy


@app.task(name="smoltorrent.gather", bind=True)
def gather(
    self,
    vkey: str,
    out_path: str,
    request_id: str | None = None,
    tensors: list[str] | None = None,
    bwlimit: int | None = None,
) -> dict:
    """Rebuild version `vkey` into out_path; with `tensors` (globs), only the tensors they
    match, as a .safetensors file of their own (a partial load). `bwlimit`: bytes/s it
    receives at most (None: this worker's SMOLTORRENT_BWLIMIT)."""
    # Whoever can reach the broker can send this task: the worker decides where it writes.
    out_path = check_destination(out_path, config.gather_dirs())
    md = metadata()
    if request_id is None:
        return _gather_task(self, md, vkey, out_path, None, tensors, bwlimit)
    if request_runs.start(self, md, request_id).done:
        return json.loads(md.requests.request(request_id)["result"])  # re-driven after it finished
    # Held while it runs: a second delivery waits instead of writing a second temp file.
    with md.requests.holding(request_id, request_runs.this_run()):
        return _gather_task(self, md, vkey, out_path, request_id, tensors, bwlimit)


def _gather_task(
    self,
    md: Metadata,
    vkey: str,
    out_path: str,
    request_id: str | None,
    tensors: list[str] | None,
    bwlimit: int | None,
) -> dict:
    task_id = self.request.id  # the request is thread-local; progress comes from threads

    def progress(done: int, total: int) -> None:
        self.update_state(task_id=task_id, state="PROGRESS", meta={"done": done, "total": total})

    reader = f"{config.host_id()}:{os.getpid()}:{task_id}"
    result = run_gather(md, vkey, out_path, tensors, reader, progress, bwlimit)
    if request_id is not None:
        md.requests.finish_request(request_id, DONE, result=json.dumps(result))
    return result


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
    manifest = md.versions.manifest(vkey)
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
    paced by the gather's meter."""
    holders = [
        [n for n in md.blobs.placement(s.blob_sha256) if n in nodes] for s in manifest.shards
    ]
    orders = read_order(holders, [s.blob_size for s in manifest.shards], md.nodes.alive(nodes))
    return [[client(nodes[n].address).paced(meter.wire) for n in order] for order in orders]


def _gather_tensors(
    md: Metadata, vkey: str, out_path: str, patterns: list[str], meter: WireMeter
) -> dict:
    """Only the tensors `patterns` select, their byte ranges read and verified one by one."""
    manifest = md.versions.manifest(vkey)
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
        # The gather goes on if the send fails: the record is the scrub sweep's to check.
        with contextlib.suppress(redis.RedisError, OperationalError):
            send_bad_copy(bad.digest, node_id)

    return record
