"""The nemesis (coordinator/local/chaos/nemesis.py) on stand-in processes: what it records
of a fault, without a cluster."""

from __future__ import annotations

from types import SimpleNamespace

from coordinator.local.chaos import Fault, Report, Schedule
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
