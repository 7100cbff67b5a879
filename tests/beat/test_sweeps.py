"""A sweep's lock left by a worker that died mid-sweep (beat/sweeps.py): the worker of
that host started again frees it at once, and the sweep runs at its next send. It used to
stand every pass down until the lock expired (ten minutes then): in a fault run, a worker
SIGKILLed mid-reconcile left two removes unsent for the rest of the run."""

from __future__ import annotations

import os
import signal
import time

from celery import Celery

from beat import sweeps
from coordinator import config
from coordinator.state import redis_keys as K
from coordinator.state.embedded_redis import start_redis, url_for
from coordinator.state.metadata import Metadata
from smoltorrent import defaults
from tests import held_cli
from tests.tasks.conftest import wait_until


def send_reconcile(c) -> None:
    app = Celery(broker=c.redis_url)
    app.send_task("smoltorrent.sweep.reconcile", queue=config.CONTROL_QUEUE)
    app.close()


def test_a_worker_started_again_frees_the_sweep_lock_its_dead_boot_held(make_cluster):
    c = make_cluster(2, worker=False)
    # Held inside the periodic pass, under the lock (a worker's boot pass reads no broker).
    worker = held_cli.start_worker(c.env(), "beat.reconcile:in_broker", c.root / "worker.log")
    try:
        wait_until(c.worker_answers, timeout=120, what="the held worker")
        send_reconcile(c)
        wait_until(lambda: held_cli.stopped_child(worker.pid), timeout=120, what="the sweep held")
    finally:
        os.killpg(worker.pid, signal.SIGKILL)  # the whole worker, as the OOM killer may
        worker.wait()
    runs = len(c.md.sweeps.sweep_runs("reconcile"))
    assert c.md.r.exists(K.SWEEP_LOCK.format(name="reconcile"))  # left by the dead

    c.start_worker()
    wait_until(c.worker_answers, timeout=120, what="the worker started again")

    def ran() -> bool:
        send_reconcile(c)
        return len(c.md.sweeps.sweep_runs("reconcile")) > runs

    wait_until(ran, timeout=30, interval=1, what="a reconcile pass")
    assert "freed the locks its last boot died holding: ['reconcile']" in c.worker_log()


def test_a_sweep_running_past_its_lock_s_ttl_keeps_the_lock(tmp_path, monkeypatch):
    """docs/self-healing.md: a sweep renews its lock while it runs, so one longer than
    SWEEP_LOCK_TTL_S (60 s) keeps it and a second send stands down meanwhile. The TTL is
    scaled down to 1.5 s here, on a real Redis; the pass takes three of them."""
    pid, port = start_redis(tmp_path / "redis")
    md = Metadata(url_for(tmp_path / "redis", port))
    try:
        monkeypatch.setattr(defaults, "SWEEP_LOCK_TTL_S", 1.5)
        monkeypatch.setattr(sweeps, "metadata", lambda: md)
        monkeypatch.setattr(sweeps, "REGISTERED", [])  # this test's sweep is nobody's
        key = K.SWEEP_LOCK.format(name="test-long")
        seen = {}

        @sweeps.sweep("test-long")
        def long_pass() -> dict:
            if seen:  # the second send, while the first still runs
                return {"ran": "twice"}
            seen["holder"] = md.r.get(key)
            time.sleep(3 * defaults.SWEEP_LOCK_TTL_S)
            seen["after"] = md.r.get(key)
            seen["second"] = long_pass()
            return {"ran": "once"}

        assert long_pass() == {"ran": "once"}
        assert seen["holder"] is not None and seen["after"] == seen["holder"]
        assert seen["second"] == {"skipped": "another test-long sweep is running"}
        assert md.r.get(key) is None  # freed at the end
    finally:
        os.kill(pid, signal.SIGTERM)
