"""Jepsen-style fault runs on a LocalCluster: a seeded nemesis, a workload of CLI
commands recorded as a history, and a checker that reads the history afterwards.

    run = ChaosRun(root, seed=7, seconds=30)
    report = run.run()          # starts the cluster, runs, heals, settles, checks, stops
    report.violations           # [] when every promise held

Everything random is drawn from `random.Random` streams named after the seed: the fault
schedule (printed by `Schedule.describe`) and each client's sequence of operations are
the same on every run of a seed; only the processes' own timing differs. The parts are
the ones a user runs (redis-server, `python -m worker_server`, `smoltorrent worker`,
`smoltorrent beat`, the `smoltorrent` CLI), each a real process; faults are real
signals, system calls failed with libfiu, clocks set off with libfaketime, and links cut
in network namespaces (coordinator/local/netns.py: each node in a namespace of its own on
one switch, the coordinator's processes here in the machine's own). Nothing here imports
Celery: the history is what the CLI printed and exited with, and the final state is what
Redis and `smoltorrent ls/status` say.

By concern: faults.py (the kinds and the seeded schedule), nemesis.py (applying them to
the processes), workload.py (contents and names), history.py (what is recorded),
checker.py (the promises), run.py (one run, end to end).
"""

from coordinator.local.chaos.checker import check
from coordinator.local.chaos.faults import (
    EIO_POINTS,
    FAKETIME_LIB,
    FAULT_KINDS,
    LINK_KINDS,
    SKEW_S,
    Fault,
    Schedule,
    available_kinds,
    draw_schedule,
    faketime_lib,
)
from coordinator.local.chaos.history import Final, Op, Report
from coordinator.local.chaos.run import ChaosRun
from coordinator.local.chaos.workload import GATHER_AT_LEAST_EVERY, NAMES, Contents

__all__ = [
    "EIO_POINTS",
    "FAKETIME_LIB",
    "FAULT_KINDS",
    "GATHER_AT_LEAST_EVERY",
    "LINK_KINDS",
    "NAMES",
    "SKEW_S",
    "ChaosRun",
    "Contents",
    "Fault",
    "Final",
    "Op",
    "Report",
    "Schedule",
    "available_kinds",
    "check",
    "draw_schedule",
    "faketime_lib",
]
