"""A Redis restart (SIGKILL, back from its AOF OUTAGE_S later) at each point where a store
or a gather command talks to Redis outside its wait: recording the request, the summary
once the store has committed, closing an in-process gather's record once its file is in
place. The command reports the operation's real outcome (the chaos run, seed 11, saw a
store exit 1 with a redis.exceptions traceback that then committed, and a gather exit 1
that left its file at the output).

Each phase is held, not timed: the command stops itself (SIGSTOP) as it enters the
function named (tests/held_cli.py), what the phase means is asserted while it is stopped,
Redis is killed, and the command goes on (SIGCONT) into the outage."""

from __future__ import annotations

import json
import os
import signal
import time

from coordinator.state.requests import QUEUED
from coordinator.state.versions import COMMITTED
from tests import held_cli
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt, sha
from tests.tasks.test_outage_while_waiting import OUTAGE_S, start_cli


def restart_redis_around(c, proc) -> None:
    """Redis killed while `proc` is held, `proc` let go into the outage, Redis back
    OUTAGE_S later."""
    c.kill_redis()
    os.kill(proc.pid, signal.SIGCONT)
    time.sleep(OUTAGE_S)
    c.start_redis()


def test_a_redis_restart_while_a_store_is_recorded_is_ridden_out(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "r.safetensors")
    store = held_cli.start(
        c.env(), "coordinator.state.requests:Requests.open_request", "store", str(src), "--json"
    )
    held_cli.wait_stopped(store)
    assert c.md.requests.open_requests() == []  # the phase: checked, not yet recorded
    restart_redis_around(c, store)
    out, err = store.communicate(timeout=180)
    # It exited 1 with a redis.exceptions.ConnectionError traceback.
    assert store.returncode == 0, err
    row = json.loads(out)
    assert row["state"] == COMMITTED
    assert [v["vkey"] for v in c.cli_json("ls")] == [row["vkey"]]


def test_a_redis_restart_while_a_committed_store_is_summed_up_exits_0(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "s.safetensors")
    store = held_cli.start(
        c.env(), "coordinator.cli.transfer_commands:_report_store", "store", str(src), "--json"
    )
    held_cli.wait_stopped(store)
    # The phase: the store has committed and its request is closed; only the summary is left.
    [version] = c.cli_json("ls")
    assert version["state"] == COMMITTED and c.md.requests.open_requests() == []
    restart_redis_around(c, store)
    out, err = store.communicate(timeout=180)
    # It exited 1 with a redis.exceptions.ConnectionError traceback: a retrying script
    # would store again what was stored.
    assert store.returncode == 0, out + err
    assert json.loads(out)["vkey"] == version["vkey"]


def test_a_redis_restart_as_an_in_process_gather_closes_its_record_exits_0(make_cluster, tmp_path):
    c = make_cluster(4)
    src = make_ckpt(tmp_path / "g.safetensors")
    c.cli("store", str(src))
    # Outside the worker's gather directories: this process gathers, not the worker.
    out_path = tmp_path / "out.safetensors"
    gather = held_cli.start(
        c.env() | {"SMOLTORRENT_GATHER_DIRS": str(c.root)},
        "coordinator.state.requests:Requests.finish_request",
        "gather",
        "g.safetensors",
        "-o",
        str(out_path),
        "--json",
    )
    held_cli.wait_stopped(gather)
    # The phase: the file is in place, whole; the request is still open (running here).
    assert sha(out_path) == sha(src)
    [(_, record)] = c.md.requests.open_requests()
    assert record["kind"] == "gather-in-process" and record["state"] != QUEUED
    restart_redis_around(c, gather)
    out, err = gather.communicate(timeout=180)
    # It exited 1 (a redis.exceptions traceback) and left the file at its output.
    assert gather.returncode == 0, err
    assert json.loads(out)["size"] == src.stat().st_size
    assert sha(out_path) == sha(src)
    assert c.md.requests.open_requests() == []


def test_a_redis_restart_as_a_workers_gather_closes_its_record_exits_0(make_cluster, tmp_path):
    c = make_cluster(3)
    src = make_ckpt(tmp_path / "w.safetensors")
    c.cli("store", str(src))
    # A worker whose pool process stops itself once the gather's file is in place.
    c.kill_worker()
    worker = held_cli.start_worker(
        c.env(), "coordinator.state.requests:Requests.finish_request", c.root / "held-worker.log"
    )
    try:
        wait_until(c.worker_answers, timeout=120, what="the held worker")
        out_path = c.root / "out.safetensors"  # where the worker writes a gather sent to it
        gather = start_cli(c, "gather", "w.safetensors", "-o", str(out_path), "--json")
        child = wait_until(
            lambda: held_cli.stopped_child(worker.pid), timeout=120, what="the gather held"
        )
        # The phase: the worker's file is in place, whole; its request is still running.
        assert sha(out_path) == sha(src)
        [(_, record)] = c.md.requests.open_requests()
        assert record["kind"] == "gather" and record["state"] == "running"
        c.kill_redis()
        os.kill(child, signal.SIGCONT)
        time.sleep(OUTAGE_S)
        c.start_redis()
        out, err = gather.communicate(timeout=180)
        # It exited 1 (the task failed closing its record) and left the file at its output.
        assert gather.returncode == 0, out + err
        assert json.loads(out)["size"] == src.stat().st_size
        assert sha(out_path) == sha(src)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
