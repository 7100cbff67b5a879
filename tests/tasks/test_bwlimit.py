"""--bwlimit through the CLI, a store's counted where the bytes land: the nodes' own counters.

Many small shards, so the nodes' counters (a blob counts once whole) move often; the rate
is taken between the first and the last blob a node counts, so neither the CLI's start
nor the plan is in it. Unlimited, every blob lands within a fraction of a second on
loopback: the bounds below are generous and still fail then by a factor of ten.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from coordinator.state.versions import COMMITTED
from tests.tasks.test_chain import node_counter
from tests.tasks.test_control_plane import make_ckpt, sha

LIMIT = 2_000_000  # bytes/s
SIZE = 4_000_000  # bytes: 2 s at the limit
SHARDS = 12  # 4 worker children send 4 chains at once


class Counted:
    """The sum of a counter over every node, sampled every 50 ms while a command runs."""

    def __init__(self, nodes, counter: str) -> None:
        self.nodes, self.counter = nodes, counter
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def total(self) -> float:
        return sum(node_counter(n, self.counter) for n in self.nodes)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.total()))
            time.sleep(0.05)

    def __enter__(self) -> Counted:
        self.start = self.total()
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic(), self.total()))

    def rate(self) -> tuple[float, float]:
        """(bytes counted, bytes/s between the first and the last blob counted)."""
        moved = [(t, n - self.start) for t, n in self.samples if n > self.start]
        final = moved[-1][1]
        t_first, first = moved[0]
        t_last = next(t for t, n in moved if n == final)
        return final, (final - first) / max(t_last - t_first, 1e-3)


def test_bwlimit_holds_the_rate_counted_at_the_nodes(make_cluster, tmp_path):
    c = make_cluster(4, SMOLTORRENT_METRICS_PORT="0")
    src = make_ckpt(tmp_path / "bw.safetensors", SIZE)
    with Counted(c.node_procs, "smoltorrent_node_bytes_received_total") as received:
        row = c.cli_json("store", str(src), "--shards", str(SHARDS), "--bwlimit", "2M")
    assert row["state"] == COMMITTED and row["min_copies"] == 2
    blob_bytes = sum(s.blob_size for s in c.md.versions.manifest(row["vkey"]).entries)
    # By chain, the source sent every blob once; the nodes passed the second copy on.
    assert (row["wire_bytes"], row["raw_bytes"], row["ratio"]) == (blob_bytes, blob_bytes, 1.0)
    landed, rate = received.rate()
    assert landed == 2 * blob_bytes
    # Each byte the source sends lands on two nodes: twice the limit at the nodes.
    print(f"store: {rate / 2e6:.2f} MB/s from the source")
    assert 0.3 * 2 * LIMIT < rate < 1.5 * 2 * LIMIT, rate

    out = tmp_path / "out.safetensors"
    before = Counted(c.node_procs, "smoltorrent_node_bytes_sent_total").total()
    report = c.cli_json("gather", "bw.safetensors", "-o", str(out), "--bwlimit", "16Mbit")
    assert sha(out) == sha(src)
    served = Counted(c.node_procs, "smoltorrent_node_bytes_sent_total").total() - before
    assert served == blob_bytes == report["wire_bytes"]
    assert report["raw_bytes"] == src.stat().st_size == report["size"]
    # A node counts a blob sent once the kernel took it, and a whole small blob fits in
    # loopback's socket buffers: the rate is the gatherer's, bytes received over its time.
    rate = report["wire_bytes"] / report["seconds"]
    print(f"gather: {rate / 1e6:.2f} MB/s")
    assert 0.3 * LIMIT < rate < 1.5 * LIMIT, rate


def test_the_workers_smoltorrent_bwlimit_is_the_default_for_a_store_naming_none(
    make_cluster, tmp_path
):
    """docs/cli.md: SMOLTORRENT_BWLIMIT where the worker runs is the cluster's default
    --bwlimit. A store sent by a CLI without it, naming no limit, keeps to the worker's:
    its sends pay into the shared token bucket (a file per limited store, none otherwise).
    Without it on the worker, the same kind of store goes unlimited."""
    c = make_cluster(3)
    c.stop_worker()
    c.start_worker(env={"SMOLTORRENT_BWLIMIT": "50M"})
    buckets = Path(c.env()["SMOLTORRENT_HOME"]) / "bwlimit"
    assert "SMOLTORRENT_BWLIMIT" not in c.env()  # the CLI names no limit
    limited = c.cli_json("store", str(make_ckpt(tmp_path / "a.safetensors", 400_000)))
    assert (buckets / limited["vkey"]).exists()
    c.stop_worker()
    c.start_worker()
    free = c.cli_json("store", str(make_ckpt(tmp_path / "b.safetensors", 400_000)))
    assert free["state"] == COMMITTED
    assert not (buckets / free["vkey"]).exists()
