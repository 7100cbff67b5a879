"""The reconcile sweep decides on the Redis server's clock, whatever the clock of the worker
running it says: one an hour behind left a lost request alone for that hour (its age was
its CLI's clock against the worker's), so versions stayed pending after a clock-skew
fault healed. libfaketime sets the sweep's process clock back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from coordinator import config
from coordinator.local.chaos import FAKETIME_LIB
from coordinator.state.versions import COMMITTED
from tests.beat.test_reconcile import FAST
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import committed, make_ckpt

STEP_S = 3600  # seconds the sweep's clock is behind


def test_a_reconcile_pass_on_a_clock_an_hour_behind_sends_a_lost_request_again(
    make_cluster, tmp_path
):
    if not os.path.exists(FAKETIME_LIB):
        pytest.skip("libfaketime is not installed (Debian: faketime)")
    c = make_cluster(3, **FAST)
    c.kill_worker()  # its boot stays the host's: a request queued for it may be lost
    src = make_ckpt(tmp_path / "c.safetensors")
    rid = c.cli_json("store", str(src), "--no-wait")["task_id"]
    # Its message lost (taken by a worker that died, dropped with a Redis that did).
    queue = config.host_queue(c.host_id)
    assert c.md.r.llen(queue) == 1
    c.md.r.delete(queue)
    created = float(c.md.requests.request(rid)["created_at"])
    wait_until(
        lambda: (
            c.md.sweeps.redis_time() - created > 2 * float(FAST["SMOLTORRENT_RECONCILE_GRACE_S"])
        ),
        what="the request to be older than the sweep's grace",
    )
    skewed = c.env() | {
        "LD_PRELOAD": FAKETIME_LIB,
        "FAKETIME": f"-{STEP_S}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
    }
    passed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from beat.reconcile import run_pass; print(json.dumps(run_pass()))",
        ],
        env=skewed,
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )
    # It sent nothing: the request looked an hour younger than it was.
    assert json.loads(passed.stdout.splitlines()[-1])["requests"] == 1
    assert c.md.r.llen(queue) == 1
    c.start_worker()
    wait_until(lambda: committed(c, "c.safetensors"), timeout=120, what="the store")
    assert c.md.requests.request(rid)["state"] == "done"
    assert [v["state"] for v in c.cli_json("ls")] == [COMMITTED]
