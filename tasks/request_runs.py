"""One run at a time per request: a store or gather task delivered a second time (Celery's
redelivery, a re-drive by the reconcile sweep or at a reconnection, a replay) while its
first run still goes on does not run beside it.

The run that starts a request holds its lease (coordinator/state/requests.py), renewed
while it runs and dropped when it ends. A second delivery that finds the lease held by a
live run is sent again for when that lease lapses and dropped now (Celery's Ignore: no
result is written over the first run's): by then the first has finished the request
(the delivery returns its recorded result) or died (the delivery takes it over). A
holder known to be dead is taken over at once: a run of an earlier boot of this host's
worker (the one serving the host now is this one), or of this boot in a process that is
gone or is this one (a prefork child runs one task at a time).
"""

from __future__ import annotations

import os

from celery.exceptions import Ignore

from coordinator.state.metadata import Metadata
from coordinator.state.requests import Start
from smoltorrent import defaults
from smoltorrent.processes import alive
from tasks.context import BOOT_ID
from tasks.event_log import fields_of, line, log


def this_run() -> str:
    """This run's name as a request's lease holder: the worker's boot and this process."""
    return f"{BOOT_ID}:{os.getpid()}"


def _dead(holder: str) -> bool:
    """Whether the run `holder` ("boot:pid") is certainly not running any more."""
    boot, _, pid = holder.rpartition(":")
    if boot != BOOT_ID or not pid.isdigit():
        return True
    return int(pid) == os.getpid() or not alive(int(pid))


def start(task, md: Metadata, request_id: str) -> Start:
    """Take request `request_id` for this run of `task` (Start.done: an earlier run
    finished it; return its result). Held by another live run: this delivery is sent
    again for when that run's lease lapses, and Ignore is raised."""
    me = this_run()
    started = md.requests.start_request(request_id, BOOT_ID, me)
    if started.holder and _dead(started.holder):
        started = md.requests.start_request(request_id, BOOT_ID, me, dead_owner=started.holder)
    if started.holder:
        wait = max(started.lease_left_s, defaults.REQUEST_DEFER_MIN_S)
        fields = fields_of(task, task.request.args, task.request.kwargs)
        fields.update(request=request_id, held_by=started.holder, again_in=f"{wait:.1f}")
        log.info(line("deferred", task, fields))
        task.signature_from_request(
            task.request, countdown=wait, retries=task.request.retries
        ).apply_async()
        raise Ignore()
    return started
