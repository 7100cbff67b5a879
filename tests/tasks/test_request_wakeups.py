"""A CLI store or gather ends when its request does, not at its next poll: whoever ends
the request (the store task closing it, the commit, the gather task) pushes a wake-up
the waiter blocks on (coordinator/state/wakeups.py). With the poll interval set to an
hour, a wait that no wake-up ended would outlast the test; the waits are counted by how
they ended, so the test says which mechanism ended them."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import redis

from tasks import requests
from tests.tasks.test_control_plane import make_blobs_ckpt

# The real CLI, with the poll interval set far past the test's timeouts and every wait for
# a wake-up counted by how it ended (printed last on stderr).
CLI_WITH_AN_HOUR_POLL = """
import atexit, json, sys
from smoltorrent import defaults
defaults.CLI_POLL_INTERVAL_S = 3600.0
from coordinator.state import wakeups
ended = {"woken": 0, "timed_out": 0}
plain_wait = wakeups.wait
def counted(*args, **kwargs):
    woken = plain_wait(*args, **kwargs)
    ended["woken" if woken else "timed_out"] += 1
    return woken
wakeups.wait = counted
atexit.register(lambda: print("WAITS " + json.dumps(ended), file=sys.stderr))
from coordinator.cli.main import run
sys.exit(run())
"""


def run_cli(cluster, *argv: str) -> tuple[dict, dict]:
    """(the command's JSON output, how its waits ended)."""
    proc = subprocess.run(
        [sys.executable, "-c", CLI_WITH_AN_HOUR_POLL, *argv, "--json"],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=120,  # far below the hour a poll would take
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    waits = proc.stderr.rpartition("WAITS ")[2]
    return json.loads(proc.stdout), json.loads(waits)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_store_and_a_gather_end_on_their_wake_ups_not_the_poll(make_cluster, tmp_path):
    cluster = make_cluster(nodes=2)
    source = make_blobs_ckpt(tmp_path / "woken.safetensors", 6)

    stored, waits = run_cli(cluster, "store", str(source), "--replicas", "2")
    assert stored["state"] == "committed"
    # The store task's end, then the commit: each wait ended by a wake-up.
    assert waits["timed_out"] == 0 and waits["woken"] >= 1, waits

    out = cluster.root / "woken-copy.safetensors"  # where the worker writes (a task gather)
    _, waits = run_cli(cluster, "gather", "woken.safetensors", "-o", str(out))
    assert sha(out) == sha(source)
    assert waits["timed_out"] == 0 and waits["woken"] >= 1, waits


def test_a_redis_that_refuses_the_block_still_gets_a_pause(monkeypatch):
    """A server before Redis 6 refuses BLPOP's fractional timeout (a ResponseError, not an
    outage): the wait falls back to the plain pause instead of polling in a tight loop."""

    def refused(*_args, **_kwargs):
        raise redis.ResponseError("timeout is not an integer or out of range")

    paused: list[float] = []

    class Noted:
        def is_set(self) -> bool:
            return False

        def wait(self, seconds: float) -> bool:
            paused.append(seconds)
            return False

    monkeypatch.setattr(requests.wakeups, "wait", refused)
    monkeypatch.setattr(requests, "_CTRL_C", Noted())
    monkeypatch.setattr(requests, "metadata", lambda: type("Md", (), {"r": None})())
    requests._pause("smoltorrent:wake:request:r1")
    assert paused == [requests.defaults.CLI_POLL_INTERVAL_S]
