"""The gather task: runs on the host that will hold the output file (the gather itself is
tasks/gathering.py, which a reader's own process runs too)."""

from __future__ import annotations

import contextlib
import json
import os

from coordinator import config
from coordinator.dataplane.gather_engine import check_destination
from coordinator.state.metadata import Metadata
from coordinator.state.requests import DONE
from smoltorrent.errors import SmoltorrentError
from tasks import request_runs
from tasks.app import app
from tasks.context import metadata
from tasks.gathering import run_gather
from tasks.requests import ride_out


@app.task(name="smoltorrent.gather", bind=True, trail=False)  # no children: tasks/store.py
def gather(
    self,
    vkey: str,
    out_path: str,
    request_id: str | None = None,
    tensors: list[str] | None = None,
    bwlimit: int | None = None,
) -> dict:
    """Rebuild version `vkey` into out_path; with `tensors` (globs), only the tensors they
    match, as a .safetensors file of their own (a partial load). `bwlimit`: bytes/s it
    receives at most (None: this worker's SMOLTORRENT_BWLIMIT)."""
    # Whoever can reach the broker can send this task: the worker decides where it writes.
    out_path = check_destination(out_path, config.gather_dirs())
    md = metadata()
    if request_id is None:
        return _gather_task(self, md, vkey, out_path, None, tensors, bwlimit)
    if request_runs.start(self, md, request_id).done:
        return json.loads(md.requests.request(request_id)["result"])  # re-driven after it finished
    # Held while it runs: a second delivery waits instead of writing a second temp file.
    with md.requests.holding(request_id, request_runs.this_run()):
        return _gather_task(self, md, vkey, out_path, request_id, tensors, bwlimit)


def _gather_task(
    self,
    md: Metadata,
    vkey: str,
    out_path: str,
    request_id: str | None,
    tensors: list[str] | None,
    bwlimit: int | None,
) -> dict:
    task_id = self.request.id  # the request is thread-local; progress comes from threads

    def progress(done: int, total: int) -> None:
        self.update_state(task_id=task_id, state="PROGRESS", meta={"done": done, "total": total})

    reader = f"{config.host_id()}:{os.getpid()}:{task_id}"
    result = run_gather(md, vkey, out_path, tensors, reader, progress, bwlimit)
    if request_id is not None:
        # The file is in place, whole and verified: the gather succeeded. A Redis restart
        # now must not fail the task (its caller then reported a failure beside a good
        # file); past the outage the request stays open and reconcile runs it again.
        with contextlib.suppress(SmoltorrentError):
            ride_out(
                lambda: md.requests.finish_request(request_id, DONE, result=json.dumps(result)),
                f"closing gather request {request_id}",
            )
    return result
