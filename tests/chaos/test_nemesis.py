"""The nemesis (coordinator/local/chaos/nemesis.py) on stand-in processes: what it records
of a fault, without a cluster."""

from __future__ import annotations

import hashlib
from itertools import pairwise
from types import SimpleNamespace

from coordinator.local.chaos import Fault, Report, Schedule, draw_schedule
from coordinator.local.chaos.faults import DESTRUCTIVE_GAP_S, DESTRUCTIVE_KINDS
from coordinator.local.chaos.nemesis import Nemesis


class DownNode:
    """A node process that is not running (another fault, or a crash, took it down)."""

    started = 0

    def is_running(self) -> bool:
        return False

    def start(self) -> None:
        self.started += 1


def test_a_fault_on_a_process_that_is_down_takes_no_effect_and_counts_for_nothing(tmp_path):
    """issue 38: a kill of a node already down was recorded and counted as a fault (and
    would excuse a hang) though it did nothing."""
    node = DownNode()
    cluster = SimpleNamespace(node_procs=[node], redis_pid=None, worker=None, beat=None)
    nemesis = Nemesis(tmp_path, 1, ("kill-node",), 0.0, cluster=cluster)
    schedule = Schedule(1, (Fault(0.0, "kill-node", 0, 0.01),))
    nemesis.run(schedule)
    [record] = nemesis.faults_applied
    assert record["took_effect"] is False and "apply_error" not in record
    figures = Report(1, schedule, [], nemesis.faults_applied, [], 1.0).figures()
    assert figures["faults"] == {} and figures["faults_without_effect"] == 1


def test_a_flipped_blob_is_reported_until_a_good_copy_replaces_it(tmp_path):
    """flip-node flips one byte of a blob file in place, on the target node or, when it
    holds none, the next node that does; unhealed() names it while it is rotten."""
    good = b"a blob's bytes" * 100
    digest = hashlib.sha256(good).hexdigest()
    empty, holder = tmp_path / "node0", tmp_path / "node1"
    blob = holder / "blobs" / digest[:2] / digest
    blob.parent.mkdir(parents=True)
    (empty / "blobs" / "00").mkdir(parents=True)
    blob.write_bytes(good)
    nodes = [SimpleNamespace(data_dir=empty), SimpleNamespace(data_dir=holder)]
    nemesis = Nemesis(tmp_path, 2, ("flip-node",), 0.0, cluster=SimpleNamespace(node_procs=nodes))
    assert nemesis._apply(Fault(0.0, "flip-node", 0, 0.1)) is True
    flipped = blob.read_bytes()
    assert (
        len(flipped) == len(good) and sum(a != b for a, b in zip(flipped, good, strict=True)) == 1
    )
    [v] = nemesis.unhealed()
    assert "node1" in v and digest[:12] in v and "rotten" in v
    blob.write_bytes(good)  # a repair's put replaced it
    assert nemesis.unhealed() == []
    blob.unlink()  # or the scrub moved it out of blobs/
    assert nemesis.unhealed() == []
    # No node holds a blob: the flip takes no effect.
    assert nemesis._apply(Fault(0.0, "flip-node", 0, 0.1)) is False


def test_a_node_lost_for_good_is_lost_once_and_destructive_faults_are_spaced():
    kinds = ("flip-node", "wipe-node", "lose-node", "kill-node", "stop-worker")
    for seed in range(20):
        faults = draw_schedule(seed, 300, 4, kinds).faults
        lost = [f for f in faults if f.kind == "lose-node"]
        assert len(lost) <= 1, faults
        if lost:  # nothing more on a node that is gone
            after = [f for f in faults if f.at_s > lost[0].at_s and f.target == lost[0].target]
            assert not [f for f in after if f.kind.endswith("node")], faults
        destructive = [f for f in faults if f.kind in DESTRUCTIVE_KINDS]
        assert all(b.at_s - a.at_s >= DESTRUCTIVE_GAP_S for a, b in pairwise(destructive))
    assert any(
        f.kind == "lose-node" for s in range(20) for f in draw_schedule(s, 300, 4, kinds).faults
    )
