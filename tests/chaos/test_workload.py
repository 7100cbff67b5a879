"""The chaos clients' operation stream (coordinator/local/chaos/), without a cluster:
the commands are recorded, not run."""

from __future__ import annotations

import threading
from itertools import pairwise

from coordinator.local.chaos import GATHER_AT_LEAST_EVERY, ChaosRun, write_contents
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
    contents = write_contents(tmp_path / "contents", 3, 20_000)
    for seed, client in ((s, c) for s in SEEDS for c in range(3)):
        run = Recorded(tmp_path / f"{seed}-{client}", seed=seed)
        run.root.mkdir()
        run.contents = contents
        run.digests = {str(p): str(i) for i, p in enumerate(contents)}
        run.stop = threading.Event()
        run._client(client, run.stop)
        kinds = [op.kind for op in run.ops if op.kind != "remove"]
        gathers = [i for i, kind in enumerate(kinds) if kind == "gather"]
        assert gathers and gathers[0] <= GATHER_AT_LEAST_EVERY, kinds
        assert all(b - a <= GATHER_AT_LEAST_EVERY + 1 for a, b in pairwise(gathers)), kinds
