"""A chain task's Redis work per chunk, and its entries' independence: the task runs in a
process of its own (Celery's apply, a retry run inline as eager tasks do) against a real
redis-server and real nodes, with nothing else talking to that Redis."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.tasks.test_chain_batches import pending_version

# Run with the cluster's environment: chain tasks over the given chunks of one pending
# version, each counted: round trips this process made to Redis (one per command or per
# pipeline sent) and commands the server ran (INFO commandstats, scripts' own calls in).
# With "fail", the first delivery of that chunk comes back failed on its first node.
RUN = """
import json, sys
import redis
from redis.connection import AbstractConnection
from smoltorrent.errors import NodeError
import tasks.chain as chain_module
from tasks.chain import chain_transfer
from tasks.chain_batches import ChainEntry, chain_message
from tasks.context import metadata
from coordinator.dataplane.chain_engine import ChainOutcome

job = json.loads(sys.argv[1])
trips = [0]
send = AbstractConnection.send_packed_command
def counted(self, command, check_health=True):
    trips[0] += 1
    return send(self, command, check_health)
AbstractConnection.send_packed_command = counted

failed = set()
real = chain_module.store_shard_chain
def store(path, identity, span, targets, *args, **kwargs):
    if span.index == job.get("fail") and span.index not in failed:
        failed.add(span.index)
        out = ChainOutcome()
        t = targets[0]
        out.failed[t.replica] = (t.node_id, NodeError("internal", "injected"))
        rest = real(path, identity, span, targets[1:], *args, **kwargs)
        out.placed |= rest.placed
        return out
    return real(path, identity, span, targets, *args, **kwargs)
chain_module.store_shard_chain = store

md = metadata()
plan = md.transfers.plan(job["vkey"])
manifest = md.versions.manifest(job["vkey"])
server = redis.Redis.from_url(job["url"])
out = []
for shards in job["tasks"]:
    entries = [
        ChainEntry(i, (0, 1), tuple(plan[i]), manifest.entries[i].blob_sha256) for i in shards
    ]
    before = server.info("commandstats")
    trips[0] = 0
    result = chain_transfer.apply(
        kwargs={"vkey": job["vkey"], "name": manifest.name, **chain_message(entries)}
    )
    mine = trips[0]
    after = server.info("commandstats")
    commands = {
        k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"]
        for k in after
        if k != "cmdstat_info"
    }
    out.append({"state": result.state, "trips": mine, "commands": commands,
                "error": None if result.state == "SUCCESS" else repr(result.result)})
print(json.dumps(out))
"""


def run_tasks(c, job: dict) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps({**job, "url": c.redis_url})],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_chain_task_makes_few_redis_round_trips_per_chunk(make_cluster, tmp_path):
    """What one more chunk in a task costs in Redis: the difference between a task of 4
    chunks and one of 16 (the task's own reads, the clock and the meter are paid once),
    after a first task that loads the scripts; the version's last chunks left unsent, so
    neither completes the barrier (and enqueues the commit)."""
    c = make_cluster(4, worker=False)
    vkey, _, _ = pending_version(c, tmp_path, 28)
    tasks = [list(range(20, 24)), list(range(4)), list(range(4, 20))]
    _, small, big = run_tasks(c, {"vkey": vkey, "tasks": tasks})
    assert small["state"] == big["state"] == "SUCCESS", (small, big)
    per_trip = (big["trips"] - small["trips"]) / 12
    per_command = (sum(big["commands"].values()) - sum(small["commands"].values())) / 12
    print(f"per chunk: {per_trip:.2f} round trips, {per_command:.2f} commands")
    print("small", small, "\nbig", big)
    # Before batching: placement and trim marks, unreachable marks, the attempts, a
    # settle per replica: 5 round trips, 23 commands (the scripts' own calls counted).
    assert per_trip <= 2.2, per_trip
    assert per_command <= 21.5, per_command
    settled = c.md.transfers.settled(vkey)
    assert settled == {f"{i}:{r}" for i in range(24) for r in (0, 1)}


def test_a_failed_entry_leaves_the_others_settled_and_is_alone_retried(make_cluster, tmp_path):
    """One chunk of a task fails on one node: every other chunk of it settles on the first
    try; the retry moves only that chunk's missing replica, and the barrier completes."""
    c = make_cluster(4, worker=False)
    vkey, targets, _ = pending_version(c, tmp_path, 8)
    (run,) = run_tasks(c, {"vkey": vkey, "tasks": [list(range(8))], "fail": 5})
    assert run["state"] == "SUCCESS", run
    attempts = c.md.transfers.attempts(vkey)
    first = [a for a in attempts if a["attempt"] == 0]
    retried = [a for a in attempts if a["attempt"] > 0]
    assert sorted((a["shard"], a["replica"]) for a in first if "result" in a) == sorted(
        (i, r) for i in range(8) for r in (0, 1) if (i, r) != (5, 0)
    )
    assert [(a["shard"], a["replica"], a["node"]) for a in first if "error" in a] == [
        (5, 0, targets[5][0])
    ]
    # The retry: chunk 5 alone; its replica 1 settled as held, and the node holding it
    # pushed replica 0 its copy (nothing from the source).
    assert {a["shard"] for a in retried} == {5}
    assert [(a["replica"], a["result"]) for a in retried] == [(0, "replicated")]
    assert c.md.transfers.settled(vkey) == {f"{i}:{r}" for i in range(8) for r in (0, 1)}
    assert c.md.transfers.barrier_complete(vkey)
