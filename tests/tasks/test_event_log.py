"""The worker's log has one structured line per task that ends or fails, naming the
checkpoint, the version, the shard and the nodes, for a store and a gather through the
real worker."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from celery import Celery

from coordinator import config
from coordinator.local.synthetic import write_checkpoint
from tasks.event_log import line
from tests.tasks.conftest import wait_until


def events(cluster, event: str, task: str) -> list[dict[str, str]]:
    """The key=value fields of every `event=EVENT task=TASK` line in the worker's log."""
    found = []
    for text in cluster.worker_log().splitlines():
        if f" event={event} task={task} " in text:
            logfmt = text[text.index("event=") :]
            pairs = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)', logfmt)
            found.append({k: v.strip('"') for k, v in pairs})
    return found


def test_a_store_and_a_gather_log_one_line_per_task(make_cluster, tmp_path: Path) -> None:
    c = make_cluster(3)
    src = tmp_path / "m.safetensors"
    write_checkpoint(src, 3_000_000, hidden=64)
    os.utime(src, (time.time() - 60, time.time() - 60))
    stored = c.cli_json("store", str(src), "--shards", "3")
    c.cli("gather", "m.safetensors", "-o", str(tmp_path / "back.safetensors"))
    registered = {n[:12] for n in c.md.nodes.nodes()}

    # One chain per shard (R=2 by default), each naming its checkpoint and two nodes.
    chains = wait_until(lambda: len(events(c, "done", "chain")) == 3 and events(c, "done", "chain"))
    assert sorted(int(e["shard"]) for e in chains) == [0, 1, 2]
    for e in chains:
        assert e["name"] == "m.safetensors" and float(e["seconds"]) >= 0
        nodes = e["nodes"].split(",")
        assert len(nodes) == 2 and set(nodes) <= registered, e
    (store,) = events(c, "done", "store")
    vkey = store["vkey"]
    assert store["name"] == "m.safetensors" and store["new"] == "True"
    # The id `ls` prints is version_id=; vkey= is the storage key every task carries.
    assert store["version_id"] == stored["version_id"][:12] != vkey
    assert all(e["vkey"] == vkey for e in chains)
    (commit,) = events(c, "done", "commit")
    assert commit["vkey"] == vkey and commit["result"] == "committed"
    (gather,) = wait_until(lambda: events(c, "done", "gather"))
    assert gather["name"] == "m.safetensors" and gather["vkey"] == vkey
    assert gather["version_id"] == stored["version_id"][:12]

    # A store of a file still being written waits for it by retrying: each retry says so.
    # Dated 5 s ahead, it is still being written when the task first looks at it, however
    # slowly the CLI starts (dated now, a CLI slower than STABLE_AFTER_S to start under
    # load found it settled, and there was no retry to log: CI, 2026-11-29).
    fresh = tmp_path / "fresh.safetensors"
    write_checkpoint(fresh, 100_000, hidden=16)
    ahead = time.time() + 5
    os.utime(fresh, (ahead, ahead))
    c.cli("store", str(fresh))
    retries = events(c, "retry", "store")
    assert retries and retries[0]["name"] == "fresh.safetensors" and retries[0]["attempt"] == "1"
    assert "Retry in" in retries[0]["error"], retries

    # A task that fails says which, on what, and why, on one line.
    app = Celery(broker=c.redis_url)
    app.send_task(
        "smoltorrent.gather",
        kwargs={"vkey": "ab" * 16, "out_path": "/etc/smoltorrent-x"},
        queue=config.CONTROL_QUEUE,
    )
    app.close()
    (failed,) = wait_until(lambda: events(c, "failed", "gather"))
    assert failed["vkey"] == "ab" * 6 and "refusing to write" in failed["error"], failed


def test_values_with_spaces_or_quotes_stay_one_field() -> None:
    class Task:
        name = "smoltorrent.transfer"

    text = line("retry", Task, {"name": 'my "run" 1', "node": "f" * 40, "error": "a\nb"})
    assert text == ('event=retry task=transfer name="my \\"run\\" 1" node=ffffffffffff error="a b"')
