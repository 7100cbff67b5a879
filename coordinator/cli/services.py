"""The long-lived commands, `worker` and `beat`: kept apart from the other commands so the CLI's
rendering (rich, the reports) is never imported into them. Every prefork pool child
starts as a copy of the worker, so a module left out is left out once per process."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import os
import sys

from coordinator import config

# macOS: the Objective-C runtime kills a forked child that touches a class whose
# +initialize another thread of the parent was running at the fork ("may have been in
# progress in another thread when fork() was called"); a library calling a system framework
# before the pool forks (urllib's proxy lookup, for one) is enough. We keep the prefork pool,
# whose time limits bound every transfer (the threads and solo pools enforce none), and turn
# that check off instead. The runtime reads this variable once, when the process starts, so
# setting it in os.environ is too late: the worker starts itself again with it set.
OBJC_FORK_SAFETY_ENV = "OBJC_DISABLE_INITIALIZE_FORK_SAFETY"


def _restart_without_objc_fork_check() -> None:
    """On macOS, replace this process by itself with the Objective-C fork check off."""
    if sys.platform == "darwin" and os.environ.get(OBJC_FORK_SAFETY_ENV) != "YES":
        os.execve(sys.executable, sys.orig_argv, {**os.environ, OBJC_FORK_SAFETY_ENV: "YES"})


def cmd_worker(args: argparse.Namespace) -> int:
    _restart_without_objc_fork_check()  # before Celery, or anything, is imported
    _say_starting()
    from celery.signals import worker_init

    from tasks.app import app
    from worker_server.server import metrics_host_from, metrics_port_from

    # Every object made so far goes where the collector never looks, before the pool
    # forks: a child's collections would otherwise write to (and so copy) every page
    # they visit. Smaller private memory per child (PSS), same code.
    worker_init.connect(lambda **_: gc.freeze(), weak=False)

    host = config.host_id()
    metrics_port = metrics_port_from(args.metrics_port)
    if metrics_port is not None:
        from tasks.metrics import enable

        metrics_host = metrics_host_from(args.metrics_host)
        bound = enable(metrics_port, config.home() / "metrics" / f"worker-{host}", metrics_host)
        print(f"metrics on http://{metrics_host}:{bound}/metrics", flush=True)
    queues = ",".join([config.CONTROL_QUEUE, config.host_queue(host), config.transfer_queue(host)])
    mingle = [] if config.worker_mingle() else ["--without-mingle"]
    app.worker_main(
        [
            "worker",
            *mingle,
            "-Q",
            queues,
            "-n",
            f"smoltorrent@{host}",
            "-P",
            "prefork",
            "-c",
            str(args.concurrency),
            "--loglevel",
            args.loglevel,
            "-E",
        ]
    )
    return 0


def _say_starting() -> None:
    """Tell Redis this host's worker is starting, first thing (Celery's boot takes
    seconds): a `store` run right after `smoltorrent worker &` waits for it."""
    from redis.exceptions import RedisError

    from tasks.context import metadata

    with contextlib.suppress(RedisError):  # no Redis: the worker's own start says so
        metadata().nodes.worker_starting(config.host_id())


def cmd_beat(args: argparse.Namespace) -> int:
    from beat import outage_log
    from tasks.app import app

    outage_log.install(app)  # a Redis restart is two lines, not a traceback per sweep

    home = config.home()
    home.mkdir(parents=True, exist_ok=True)
    # Beat keeps each entry's last run in this file, so a restart does not wait a whole
    # interval again (a daily scrub would never run under a beat restarted more often). The
    # file (a dbm.dumb shelf) has no lock of its own: two beats writing it corrupt it, and
    # a corrupt entry can stop a sweep being sent. The first beat on a home holds the lock
    # while it runs; another one keeps its schedule in memory (the sweeps' own lock makes
    # two beats safe).
    lock = open(home / "beat-schedule.lock", "a")  # noqa: SIM115  (held until exit)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        where = ["--schedule", str(home / "beat-schedule")]
    except BlockingIOError:
        print(
            f"another beat on {home} keeps the schedule file; this one keeps its schedule in"
            " memory (sweeps stay safe: each runs once at a time)",
            file=sys.stderr,
            flush=True,
        )
        where = ["--scheduler", "celery.beat:Scheduler"]
    app.start(["beat", *where, "--loglevel", args.loglevel])
    lock.close()
    return 0
