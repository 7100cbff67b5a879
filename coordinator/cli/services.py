"""The long-lived commands, `worker` and `beat`: kept apart from commands.py so the CLI's
rendering (rich, the reports) is never imported into them. Every prefork pool child
starts as a copy of the worker, so a module left out is left out once per process."""

from __future__ import annotations

import argparse
import gc

from coordinator import config


def cmd_worker(args: argparse.Namespace) -> int:
    from celery.signals import worker_init

    from tasks.app import app
    from worker_server.server import metrics_port_from

    # Every object made so far goes where the collector never looks, before the pool
    # forks: a child's collections would otherwise write to (and so copy) every page
    # they visit. Smaller private memory per child (PSS), same code.
    worker_init.connect(lambda **_: gc.freeze(), weak=False)

    host = config.host_id()
    metrics_port = metrics_port_from(args.metrics_port)
    if metrics_port is not None:
        from tasks.metrics import enable

        bound = enable(metrics_port, config.home() / "metrics" / f"worker-{host}")
        print(f"metrics on http://0.0.0.0:{bound}/metrics", flush=True)
    queues = ",".join([config.CONTROL_QUEUE, config.host_queue(host), config.transfer_queue(host)])
    app.worker_main(
        [
            "worker",
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


def cmd_beat(args: argparse.Namespace) -> int:
    from tasks.app import app

    home = config.home()
    home.mkdir(parents=True, exist_ok=True)
    # Beat keeps each entry's last run in this file, so a restart does not re-send them all.
    app.start(["beat", "--schedule", str(home / "beat-schedule"), "--loglevel", args.loglevel])
    return 0
