"""The chaos clients' operation stream (coordinator/local/chaos/), without a cluster:
the commands are recorded, not run."""

from __future__ import annotations

import threading
from itertools import pairwise
from pathlib import Path

from coordinator.local.chaos import GATHER_AT_LEAST_EVERY, ChaosRun, Contents
from coordinator.local.chaos.workload import TAG_BYTES, sha256_file
from tests.chaos.test_chaos import SEEDS


class Recorded(ChaosRun):
    """A run whose commands all succeed at once, stopping after `limit` operations."""

    limit: int = 40
    stop: threading.Event | None = None

    def _cli(self, *argv, timeout=0.0):
        if len(self.ops) >= self.limit:
            self.stop.set()
        if argv[0] == "gather":
            open(argv[-1], "wb").close()
        return 0, "", ""


def test_a_client_gathers_at_least_every_few_operations_once_it_stored(tmp_path):
    """However few operations a loaded machine runs in the window, each client reads back:
    seed 181 once ran 11 operations under load and drew no gather among them."""
    contents = Contents(tmp_path / "contents", 20_000)
    for seed, client in ((s, c) for s in SEEDS for c in range(3)):
        run = Recorded(tmp_path / f"{seed}-{client}", seed=seed)
        run.root.mkdir()
        run.contents = contents
        run.stop = threading.Event()
        run._client(client, run.stop)
        kinds = [op.kind for op in run.ops if op.kind != "remove"]
        gathers = [i for i, kind in enumerate(kinds) if kind == "gather"]
        assert gathers and gathers[0] <= GATHER_AT_LEAST_EVERY, kinds
        assert all(b - a <= GATHER_AT_LEAST_EVERY + 1 for a, b in pairwise(gathers)), kinds


def test_every_store_writes_content_of_its_own_and_a_rollback_an_earlier_stores(tmp_path):
    """issue 38: the workload had 4 contents, so a stale read, a read of a pending version
    or a read across names gathered bytes some store of the name had sent, and passed.
    Each store's bytes are unique now (one tensor set from a tag of its own), so a digest
    names its store; a rollback writes the bytes of an earlier store of its name."""
    run = Recorded(tmp_path / "run", seed=SEEDS[0])
    run.root.mkdir()
    run.contents = Contents(tmp_path / "contents", 20_000)
    run.stop = threading.Event()
    run.limit = 60
    run._client(0, run.stop)
    writes = [op for op in run.ops if op.kind in ("store", "store-no-wait", "rollback")]
    stores = [op for op in writes if op.kind != "rollback"]
    rollbacks = [op for op in writes if op.kind == "rollback"]
    assert stores and rollbacks, [op.kind for op in run.ops]
    assert len({op.content for op in stores}) == len(stores)
    for rb in rollbacks:
        earlier = [s for s in stores if s.content == rb.content]
        assert earlier and earlier[0].name == rb.name and earlier[0].invoked < rb.invoked
    for op in writes:  # each source holds the bytes recorded for it
        assert sha256_file(op.path) == op.content
    # Versions still share blobs: two stores' sources differ in the tagged bytes only.
    a, b = (Path(op.path).read_bytes() for op in stores[:2])
    differ = [i for i in range(len(a)) if a[i] != b[i]]
    assert len(a) == len(b) and differ and differ[-1] - differ[0] < TAG_BYTES
