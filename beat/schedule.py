"""The beat schedule: one entry per sweep (task name, interval, queue).

Plain data, read by tasks/app.py; `smoltorrent beat` sends each entry on time.
"""

from __future__ import annotations

from coordinator import config

SCHEDULE = {
    "reconcile": {
        "task": "smoltorrent.sweep.reconcile",
        "schedule": config.reconcile_interval(),
        "options": {"queue": config.CONTROL_QUEUE},
    },
    "crosscheck": {
        "task": "smoltorrent.sweep.crosscheck",
        "schedule": config.crosscheck_interval(),
        "options": {"queue": config.CONTROL_QUEUE},
    },
    "retention": {
        "task": "smoltorrent.sweep.retention",
        "schedule": config.retention_interval(),
        "options": {"queue": config.CONTROL_QUEUE},
    },
    "health": {
        "task": "smoltorrent.sweep.health",
        "schedule": config.health_interval(),
        # A probe older than the next one is worth nothing: drop it if no worker took it.
        "options": {"queue": config.CONTROL_QUEUE, "expires": config.health_interval()},
    },
    "repair": {
        "task": "smoltorrent.sweep.repair",
        "schedule": config.repair_interval(),
        "options": {"queue": config.CONTROL_QUEUE, "expires": config.repair_interval()},
    },
    "scrub": {
        "task": "smoltorrent.sweep.scrub",
        "schedule": config.scrub_interval(),
        "options": {"queue": config.CONTROL_QUEUE, "expires": config.scrub_interval()},
    },
}
