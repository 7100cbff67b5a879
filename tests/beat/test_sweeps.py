"""A sweep's lock left by a worker that died mid-sweep (beat/sweeps.py): the worker of
that host started again frees it at once, and the sweep runs at its next send. It used to
stand every pass down until the lock expired (ten minutes then): in a fault run, a worker
SIGKILLed mid-reconcile left two removes unsent for the rest of the run."""

from __future__ import annotations

import os
import signal

from celery import Celery

from coordinator import config
from coordinator.state import redis_keys as K
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
