"""A CLI that is waiting on an operation when Redis (metadata and broker) is SIGKILLed and
started again from its AOF a few seconds later reports the operation's real outcome.

The phase is held, not timed: the worker is SIGKILLed before the command starts (its
alive key still says it serves the host, so the command is accepted), so the task is
still in its queue (asserted) when Redis goes, and the command can only be waiting. A
worker started after the outage runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager

from coordinator import config
from coordinator.state.requests import QUEUED
from coordinator.state.versions import COMMITTED
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt, sha

# seconds Redis stays down: a restart, longer than the ~4 s redis-py's own retries last
OUTAGE_S = 6.0


@contextmanager
def worker_held(c):
    """No worker runs anything during the block; a new one starts after it."""
    c.kill_worker()
    try:
        yield
    finally:
        c.start_worker()


def start_cli(c, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *argv],
        env=c.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def restart_redis_under(c, proc: subprocess.Popen, kind: str) -> None:
    """Once `proc`'s request is recorded and its task queued, Redis is killed and started
    again OUTAGE_S later."""
    queue = config.host_queue(c.host_id)
    wait_until(lambda: c.md.r.llen(queue), timeout=60, what=f"the {kind} task in its queue")
    # The phase: the command waits on a queued request that nothing has run.
    assert [r["state"] for _, r in c.md.requests.open_requests()] == [QUEUED]
    assert c.md.requests.open_requests()[0][1]["kind"] == kind and proc.poll() is None
    c.kill_redis()
    time.sleep(OUTAGE_S)
    c.start_redis()


def test_a_store_waiting_through_a_redis_restart_exits_0_once_it_commits(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "w.safetensors")
    with worker_held(c):
        store = start_cli(c, "store", str(src), "--json")
        restart_redis_under(c, store, "store")
    out, err = store.communicate(timeout=180)
    # It exited 1 with "redis.exceptions.ConnectionError" and the store then committed.
    assert store.returncode == 0, err
    row = json.loads(out)
    assert row["state"] == COMMITTED and row["min_copies"] == 2
    assert [v["vkey"] for v in c.cli_json("ls") if v["state"] == COMMITTED] == [row["vkey"]]
    gathered = tmp_path / "out.safetensors"
    c.cli("gather", "w.safetensors", "-o", str(gathered))
    assert sha(gathered) == sha(src)


def test_a_gather_waiting_through_a_redis_restart_exits_0_with_the_file(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "g.safetensors")
    c.cli("store", str(src))
    gathered = tmp_path / "out.safetensors"
    with worker_held(c):
        gather = start_cli(c, "gather", "g.safetensors", "-o", str(gathered), "--json")
        restart_redis_under(c, gather, "gather")
    out, err = gather.communicate(timeout=180)
    assert gather.returncode == 0, err
    assert json.loads(out)["size"] == src.stat().st_size
    assert sha(gathered) == sha(src)
