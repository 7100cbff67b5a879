"""What a command waiting on a sent gather takes for its end (tasks/requests.wait_gather):
the request's record, not Celery's result alone. A run that lost Redis fails in Celery's
eyes, yet leaves its request open to be sent again (tasks/dead_letters.py); the command
took that failure for the gather's, exited 1 saying "Nothing was written", and the run
sent again then wrote the file (the fault run, bench.chaos --overlap --seed 2003)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.smoltorrent.conftest import ROOT

WAIT = """
import json, sys, threading
import redis
from coordinator import config
from coordinator.state.requests import DONE, FAILED
from tasks.app import app
from tasks.context import metadata
from tasks.requests import GatherRequest, wait_gather

md, out, ending = metadata(), sys.argv[1], sys.argv[2]
rid = f"gather-{ending}"
md.requests.open_request(rid, "gather", config.host_id(), {"vkey": "v", "out": out})
md.requests.start_request(rid, "a-run")
# Celery's word on the first run: failed, cut off from Redis (as the worker stores it).
app.backend.mark_as_failure(rid, redis.exceptions.ConnectionError("Error 111 connecting"))

def the_run_sent_again_ends():
    if ending == "done":
        md.requests.finish_request(rid, DONE, result=json.dumps({"path": out, "size": 7}))
    else:
        md.requests.finish_request(rid, FAILED, error="GatherError: no copy of shard 0")
    app.backend.mark_as_failure(rid, RuntimeError("a later run's own failure"))

threading.Timer(1.0, the_run_sent_again_ends).start()
try:
    print(json.dumps(wait_gather(GatherRequest(rid, "w.safetensors", "v", out, 7))))
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
"""


def wait_for(c, out, ending: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WAIT), str(out), ending],
        env=c.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_gather_that_celery_says_failed_is_waited_for_while_its_request_is_open(
    make_cluster, tmp_path
):
    c = make_cluster(1, worker=False)
    done = wait_for(c, tmp_path / "w.safetensors", "done")
    # It exited 1 at once: "gather of w.safetensors failed: Error 111 connecting. Nothing
    # was written at ...".
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["size"] == 7

    failed = wait_for(c, tmp_path / "f.safetensors", "failed")
    assert failed.returncode == 1
    # The request's own error, not Celery's word on a run that was sent again.
    assert "no copy of shard 0" in failed.stderr and "Error 111" not in failed.stderr, failed
