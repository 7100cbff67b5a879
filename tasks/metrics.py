"""The worker's Prometheus metrics, off unless `worker --metrics-port` (or
SMOLTORRENT_METRICS_PORT) asks for them.

Transfers run in prefork children, so the counters and histograms use
prometheus-client's multiprocess mode: each child writes its samples to files
under a directory the main process wipes at start, and the main process serves
their sum. The alternative, counters kept in Redis, would put a write on every
transfer and be summed twice by every worker of a cluster that exports them.
Multiprocess mode forbids live gauges with custom collectors only inside the
children; the cluster's state (nodes up, under-replicated shards, dead letters)
is a collector in the main process that reads Redis at scrape time, so no child
keeps a gauge and no dead child's file needs cleaning up.

The metrics wrap the tasks through Celery signals: the tasks stay unaware of them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from celery.signals import task_postrun, task_prerun, task_retry
from redis.exceptions import RedisError

from coordinator import config
from coordinator.state import process_gathers, repairs, scrub_reports
from coordinator.state.liveness import probe_registered
from coordinator.state.repair_plan import TRIM
from coordinator.state.versions import COMMITTED, PENDING
from smoltorrent import defaults
from smoltorrent.errors import ManifestError, NotFoundError, SmoltorrentError
from tasks.context import metadata

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_m = SimpleNamespace()
# task id -> (monotonic start, its shard's blob size if a transfer), in the child running it
_started: dict[str, tuple[float, int | None]] = {}


def enable(port: int, directory: Path, host: str = defaults.METRICS_HOST) -> int:
    """Serve /metrics on port (0 picks one) from this, the worker's main process, before
    its pool forks; returns the bound port."""
    if os.environ.get(MULTIPROC_ENV) != str(directory):
        # prometheus_client picks its multiprocess value class when first imported.
        if "prometheus_client" in sys.modules:
            raise SmoltorrentError(
                "prometheus_client was imported before the worker's metrics were set up"
            )
        os.environ[MULTIPROC_ENV] = str(directory)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)

    from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    _m.store_seconds = Histogram(
        "smoltorrent_store_seconds",
        "Wall time of a store, from its plan to its commit.",
        buckets=defaults.WORKER_SECONDS_BUCKETS,
    )
    _m.gather_seconds = Histogram(
        "smoltorrent_gather_seconds",
        "Wall time of a gather.",
        buckets=defaults.WORKER_SECONDS_BUCKETS,
    )
    # By node: its id, and its address (host:port) so a person reads which machine it is.
    _m.transfer_bytes = Counter(
        "smoltorrent_transfer_bytes",
        "Shard bytes moved onto a node, by node.",
        ["node", "address"],
    )
    _m.transfer_seconds = Histogram(
        "smoltorrent_transfer_seconds",
        "Time of one shard transfer that moved bytes, by node.",
        ["node", "address"],
        buckets=defaults.WORKER_SECONDS_BUCKETS,
    )
    _m.transfer_retries = Counter(
        "smoltorrent_transfer_retries", "Transfers that failed and were retried."
    )
    # raw / wire over any window is the encoding's gain: rate(raw[5m]) / rate(wire[5m])
    _m.raw_bytes = Counter(
        "smoltorrent_raw_bytes",
        "Checkpoint bytes, as they are in the file, that stores sent from this host's"
        " source (direction=store, counted at commit) or gathers wrote (direction=gather).",
        ["direction"],
    )
    _m.wire_bytes = Counter(
        "smoltorrent_wire_bytes",
        "Bytes this host's link carried for them (encoded chunks are fewer than raw).",
        ["direction"],
    )
    registry = CollectorRegistry()
    registry.register(ProcessGathers())  # before the files are read: its samples go in them
    MultiProcessCollector(registry)
    registry.register(ClusterCollector())
    task_prerun.connect(_on_prerun, weak=False)
    task_postrun.connect(_on_postrun, weak=False)
    task_retry.connect(_on_retry, weak=False)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise SmoltorrentError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}): pick a free port "
            "with --metrics-port (or SMOLTORRENT_METRICS_PORT)"
        ) from None
    return server.server_address[1]


class ProcessGathers:
    """Counts, at each scrape, the gathers this host ran in a process of its own (the CLI,
    load(); coordinator/state/process_gathers.py) with the worker's own: it adds no
    metric, it observes into the worker's before they are read."""

    def describe(self):
        return []

    def collect(self):
        with contextlib.suppress(SmoltorrentError, RedisError):
            for done in process_gathers.take(metadata(), config.host_id()):
                _count_gather(done)
        return []


class ClusterCollector:
    """The cluster's state as gauges, read from Redis (and a probe of the nodes) per scrape."""

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        md = metadata()
        nodes = md.nodes.nodes()
        live = probe_registered(md, config.cluster_key(), trust_recent=True)
        up = GaugeMetricFamily("smoltorrent_nodes_up", "Registered nodes answering.")
        up.add_metric([], len(live))
        registered = GaugeMetricFamily("smoltorrent_nodes", "Registered nodes.")
        registered.add_metric([], len(nodes))
        dead = GaugeMetricFamily("smoltorrent_dead_letters", "Tasks that failed for good.")
        dead.add_metric([], md.dead_letters.dead_letter_depth())
        # From the listing summaries, only the versions that count (pending, or committed
        # with a shard under R by live copies): a few requests per scrape, no manifest read,
        # whatever the number of versions.
        rows = md.listing.version_summaries(None, nodes, set(live) & set(nodes), notable=set())
        pending = sum(r["state"] == PENDING for r in rows)
        under = sum(
            sum(c < r["replicas"] for c in r["live"]) for r in rows if r["state"] == COMMITTED
        )
        under_g = GaugeMetricFamily(
            "smoltorrent_under_replicated_shards",
            "Shards of committed versions with fewer live copies than their replicas.",
        )
        under_g.add_metric([], under)
        pending_g = GaugeMetricFamily("smoltorrent_pending_versions", "Versions not committed.")
        pending_g.add_metric([], pending)
        return [up, registered, dead, under_g, pending_g, *_healing_gauges(md)]


def _healing_gauges(md) -> list:
    """What the health, repair and scrub sweeps last recorded (no probe of their own)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(name: str, text: str, value: float):
        g = GaugeMetricFamily(name, text)
        g.add_metric([], value)
        return g

    done = CounterMetricFamily(
        "smoltorrent_repairs", "Repair copies made and surplus copies trimmed.", labels=["what"]
    )
    # Both present from the start, so a dashboard's increase() has a series at zero.
    made = {"repaired": 0, "trimmed": 0, **repairs.counts(md)}
    for what, n in sorted(made.items()):
        done.add_metric([what], n)
    scrubs = scrub_reports.reports(md).values()
    copies = [r for r in repairs.in_flight(md) if r.target != TRIM]
    return [
        gauge(
            "smoltorrent_nodes_dead",
            "Nodes declared dead by the health sweep.",
            len(md.nodes.declared_dead()),
        ),
        gauge("smoltorrent_repairs_in_flight", "Repair copies sent and not finished.", len(copies)),
        gauge(
            "smoltorrent_repairs_waiting",
            "Repair copies that failed and wait out their backoff (see smoltorrent status).",
            len(repairs.backing_off(md)),
        ),
        gauge(
            "smoltorrent_unrepairable_blobs",
            "Blobs below R that no repair can raise now (see smoltorrent status).",
            len(repairs.unrepairable(md)),
        ),
        gauge(
            "smoltorrent_bad_copies_held",
            "Bad copies the nodes' scrubs hold in quarantine.",
            sum(len(r.get("quarantined", [])) for r in scrubs),
        ),
        done,
    ]


_TRANSFERS = ("smoltorrent.transfer", "smoltorrent.chain")


def _on_prerun(sender=None, task_id=None, kwargs=None, **_) -> None:
    # The shard's size is read now, while its version is pending and its span is kept in
    # Redis (a commit racing the task's end drops it; the manifest would be megabytes). A
    # chain task returns the bytes it moved onto each node itself.
    size = None
    if sender is not None and sender.name == "smoltorrent.transfer":
        with contextlib.suppress(NotFoundError, ManifestError, KeyError, IndexError, TypeError):
            size = metadata().transfers.span(kwargs["vkey"], kwargs["shard"]).size
    _started[task_id] = (time.monotonic(), size)


def _on_postrun(sender=None, task_id=None, kwargs=None, args=None, retval=None, state=None, **_):
    started, size = _started.pop(task_id, (None, None))
    if state != "SUCCESS" or sender is None:
        return
    if sender.name in _TRANSFERS and started is not None:
        moved = _moved(sender.name, kwargs or {}, retval, size)
        registered = metadata().nodes.nodes() if moved else {}
        for node, n in moved.items():
            rec = registered.get(node)
            address = str(rec.address) if rec is not None else ""
            _m.transfer_bytes.labels(node=node, address=address).inc(n)
            seconds = time.monotonic() - started
            _m.transfer_seconds.labels(node=node, address=address).observe(seconds)
    elif sender.name == "smoltorrent.gather" and isinstance(retval, dict):
        _count_gather(retval)
    elif sender.name == "smoltorrent.commit" and retval == COMMITTED:
        vkey = (kwargs or {}).get("vkey") or (args or [None])[0]
        try:
            created = float(metadata().versions.version(vkey)["created_at"])
            raw, wire = metadata().transfers.wire(vkey)
        except (NotFoundError, KeyError, TypeError, ValueError):
            return
        _m.store_seconds.observe(max(time.time() - created, 0.0))
        _m.raw_bytes.labels(direction="store").inc(raw)
        _m.wire_bytes.labels(direction="store").inc(wire)


def _count_gather(done: dict) -> None:
    _m.gather_seconds.observe(float(done.get("seconds", 0)))
    _m.raw_bytes.labels(direction="gather").inc(int(done.get("raw_bytes", 0)))
    _m.wire_bytes.labels(direction="gather").inc(int(done.get("wire_bytes", 0)))


def _moved(task: str, kwargs: dict, retval, size: int | None) -> dict[str, int]:
    """Node -> shard bytes a delivery task moved onto it: a transfer's one node got its
    shard's `size` if it was sent there; a chain task counts every entry's own."""
    if task == "smoltorrent.transfer":
        moved = size is not None and retval in ("sent", "replicated")
        return {kwargs.get("node_id", ""): size} if moved else {}
    found = retval.get("bytes") if isinstance(retval, dict) else None
    return {node: int(n) for node, n in (found or {}).items() if n}


def _on_retry(sender=None, **_) -> None:
    if sender is not None and sender.name in ("smoltorrent.transfer", "smoltorrent.chain"):
        _m.transfer_retries.inc()
