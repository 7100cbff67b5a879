"""The health sweep on a real cluster: `smoltorrent beat`, a real worker, real nodes.

Intervals of a second through the environment, as a user would shorten them."""

from __future__ import annotations

import subprocess
import sys
import time

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
