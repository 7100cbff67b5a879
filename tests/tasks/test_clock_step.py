"""A worker whose wall clock stepped back does not hold a retry for as long as the step.

Celery writes a countdown into the message as a wall-clock ETA (the sender's clock) and
the receiving worker holds the message until its own wall clock reaches it; a worker an
hour behind held a retry of 2 s for an hour (the chaos run's skew-worker fault: versions
still pending after its faults healed). The worker's clock is set back with libfaketime,
its monotonic clock left true, as NTP stepping a wall clock leaves it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from coordinator import config
from coordinator.local.chaos import FAKETIME_LIB
from coordinator.state.versions import COMMITTED
from tests.beat.test_reconcile import pending_as_left_by_a_crash
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt, sha

STEP_S = 3600  # seconds the worker's clock is behind: far longer than the test waits
COUNTDOWN_S = 2  # the retry's countdown, as the commit's first backoff step


def test_a_retry_sent_before_the_workers_clock_stepped_back_waits_its_countdown_not_the_step(
    make_cluster, tmp_path
):
    if not os.path.exists(FAKETIME_LIB):
        pytest.skip("libfaketime is not installed (Debian: faketime)")
    c = make_cluster(3, chunks=False)
    src = make_ckpt(tmp_path / "t.safetensors")
    c.kill_worker()
    # Every blob placed and settled, the commit not run: as a commit retried. Recorded for
    # another host, so this worker's start re-drives nothing of it: only the retry below
    # can commit it.
    vkey = pending_as_left_by_a_crash(c, src, send_blobs=True)
    c.md.r.hset(f"smoltorrent:version:{vkey}", "host", "elsewhere")
    # The retry, sent on the true clock (as by this worker before its clock stepped).
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tasks.app import app; app.send_task('smoltorrent.commit',"
            " args=[sys.argv[1]], task_id='commit-' + sys.argv[1], queue=sys.argv[2],"
            " countdown=float(sys.argv[3]))",
            vkey,
            config.CONTROL_QUEUE,
            str(COUNTDOWN_S),
        ],
        env=c.env(),
        check=True,
        timeout=60,
    )
    c.start_worker(
        env={
            "LD_PRELOAD": FAKETIME_LIB,
            "FAKETIME": f"-{STEP_S}",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1",
        }
    )
    # The phase: the worker has the retry (unacked, held for its ETA), the version pending.
    # On a loaded machine the worker can start after the countdown is over: it then runs
    # the retry at once (the CI saw it come and go between two polls), which is the
    # promise too; a worker holding it for the step would show neither.
    wait_until(
        lambda: c.md.r.hlen("unacked") or c.md.versions.version(vkey)["state"] == COMMITTED,
        what="the worker to take the retry",
    )
    # It was held STEP_S (an hour): this waited its 120 s and failed.
    wait_until(
        lambda: c.md.versions.version(vkey)["state"] == COMMITTED,
        timeout=120,
        what="the retried commit",
    )
    out = tmp_path / "out.safetensors"
    c.cli("gather", "t.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
