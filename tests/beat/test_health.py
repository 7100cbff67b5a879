"""The health sweep on a real cluster: `smoltorrent beat`, a real worker, real nodes.

Intervals of a second through the environment, as a user would shorten them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from coordinator.local.chaos import FAKETIME_LIB
from tests.tasks.conftest import wait_until

FAST = {"SMOLTORRENT_HEALTH_INTERVAL_S": "1", "SMOLTORRENT_DEAD_AFTER_S": "3"}


def test_a_killed_node_is_dead_in_status_and_readmitted_when_it_returns(make_cluster, beat):
    c = make_cluster(3, **FAST)
    victim = c.node_procs[0]
    victim_id = victim.client().ping()
    started = time.time()
    beat(c)
    # The sweep alone keeps every node's last-seen time fresh: no command probes them here.
    wait_until(
        lambda: all(t > started for t in c.md.nodes.last_seen().values()),
        timeout=60,
        what="a health sweep refreshing every node",
    )
    victim.kill()
    killed_at = time.time()
    wait_until(
        lambda: victim_id in c.md.nodes.declared_dead(),
        timeout=60,
        what="the sweep declaring it dead",
    )
    status = c.cli_json("status")
    rows = {n["node_id"]: n for n in status["nodes"]}
    assert rows[victim_id]["state"] == "dead"
    assert rows[victim_id]["up"] is False
    assert rows[victim_id]["last_seen"] <= killed_at
    assert {n["state"] for i, n in rows.items() if i != victim_id} == {"up"}
    assert "DEAD" in c.cli("status").stdout

    victim.start()
    wait_until(
        lambda: victim_id not in c.md.nodes.declared_dead(),
        timeout=60,
        what="the sweep re-admitting it",
    )
    rows = {n["node_id"]: n for n in c.cli_json("status")["nodes"]}
    assert rows[victim_id]["state"] == "up"
    assert rows[victim_id]["last_seen"] > killed_at


def test_a_node_silent_less_than_the_dead_timeout_is_down_not_dead(make_cluster):
    c = make_cluster(2, SMOLTORRENT_DEAD_AFTER_S="3600")
    victim = c.node_procs[1]
    victim_id = victim.client().ping()
    victim.kill()
    rows = {n["node_id"]: n for n in c.cli_json("status")["nodes"]}
    assert rows[victim_id]["state"] == "down"
    assert rows[victim_id]["last_seen"] is not None  # registering it was an answer


def test_a_bad_interval_is_one_line_and_exit_2(make_cluster):
    c = make_cluster(1, worker=False)
    env = {**c.env(), "SMOLTORRENT_DEAD_AFTER_S": "soon"}
    bad = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "SMOLTORRENT_DEAD_AFTER_S" in bad.stderr
    assert "Traceback" not in bad.stderr


def _health_pass(c, skew_s: int = 0) -> dict:
    """One health pass in a process of its own, its wall clock `skew_s` off (libfaketime)."""
    env = c.env()
    if skew_s:
        env |= {
            "LD_PRELOAD": FAKETIME_LIB,
            "FAKETIME": f"{skew_s:+d}",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_NO_CACHE": "1",
        }
    done = subprocess.run(
        [sys.executable, "-c", PASS],
        env=env,
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


PASS = "import json; from beat.health import run_pass; print(json.dumps(run_pass()))"
SKEW_S = 300  # minutes off, as a host without NTP


@pytest.mark.parametrize("skew_s", [SKEW_S, -SKEW_S])
def test_a_node_is_dead_after_the_dead_timeout_whatever_the_clock_that_last_saw_it(
    make_cluster, skew_s
):
    """Liveness is on the Redis server's clock: a worker minutes ahead that last saw a node
    kept it "down", its copies counted, for those minutes after it died (a fault run's lost
    node was never repaired once the skewed worker was restarted on a true clock); one
    minutes behind made a node that missed one probe dead at once, a node's worth of
    copying set off by a blip."""
    if not os.path.exists(FAKETIME_LIB):
        pytest.skip("libfaketime is not installed (Debian: faketime)")
    dead_after = 3.0
    c = make_cluster(3, worker=False, SMOLTORRENT_DEAD_AFTER_S=str(dead_after))
    victim = c.node_procs[0]
    victim_id = victim.client().ping()
    assert _health_pass(c, skew_s)["up"] == 3  # seen last by the skewed process
    victim.kill()
    killed = c.md.sweeps.redis_time()
    first = _health_pass(c)  # true clock, within the dead timeout of that last answer
    if c.md.sweeps.redis_time() - killed < dead_after:
        assert first["dead"] == 0, first
    wait_until(
        lambda: c.md.sweeps.redis_time() - killed > dead_after + 1,
        what="the dead timeout to pass",
    )
    assert _health_pass(c)["newly_dead"] == 1
    rows = {n["node_id"]: n for n in c.cli_json("status")["nodes"]}
    assert rows[victim_id]["state"] == "dead"
