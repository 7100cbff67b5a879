"""Two `smoltorrent beat` processes on one cluster: every sweep is sent twice as often,
yet no sweep ever runs twice at once (the lock in beat/sweeps.py)."""

from __future__ import annotations

import signal

from tests.beat.test_retention import beat_process  # noqa: F401  (a fixture, used by name)
from tests.tasks.conftest import wait_until

FAST = {
    "SMOLTORRENT_CROSSCHECK_INTERVAL_S": "1",
    "SMOLTORRENT_RECONCILE_INTERVAL_S": "1",
    "SMOLTORRENT_RETENTION_INTERVAL_S": "1",
}


def overlapping(runs: list[dict]) -> list[tuple[dict, dict]]:
    ordered = sorted(runs, key=lambda r: r["started"])
    pairs = zip(ordered, ordered[1:], strict=False)
    return [(a, b) for a, b in pairs if b["started"] < a["finished"]]


def test_two_beats_never_run_a_sweep_twice_at_once(make_cluster, beat_process, tmp_path):  # noqa: F811
    c = make_cluster(2, concurrency=4, **FAST)
    beat_process(c)
    beat_process(c)
    md = c.md
    wait_until(lambda: len(md.sweeps.sweep_runs("crosscheck")) >= 2, timeout=60, what="crosschecks")
    # A node frozen mid-crosscheck holds one pass for as long as the test likes, while
    # both beats keep sending it every second to a worker with free processes.
    node = c.node_procs[0]
    node.send_signal(signal.SIGSTOP)
    try:
        skips = md.sweeps.sweep_skips("crosscheck")
        wait_until(
            lambda: md.sweeps.sweep_skips("crosscheck") >= skips + 6, timeout=60, what="stand-downs"
        )
    finally:
        node.send_signal(signal.SIGCONT)
    runs = md.sweeps.sweep_runs("crosscheck")
    wait_until(
        lambda: len(md.sweeps.sweep_runs("crosscheck")) > len(runs), timeout=60, what="a run"
    )
    for name in ("crosscheck", "reconcile", "retention"):
        runs = md.sweeps.sweep_runs(name)
        assert runs and overlapping(runs) == [], name
    logs = [p.read_text() for p in sorted(tmp_path.glob("beat*.log"))]
    assert all("smoltorrent.sweep.crosscheck" in log for log in logs)
    # One schedule file, written by one beat only (two writers corrupt it).
    assert sum("keeps its schedule in memory" in log for log in logs) == 1
