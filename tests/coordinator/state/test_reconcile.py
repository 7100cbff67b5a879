"""What a worker sends again when its broker connection comes back, decided on a real
redis-server from the state and what live tasks hold."""

from __future__ import annotations

import os
import signal

import pytest

from coordinator.dataplane.store_engine import prepare_store
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.embedded_redis import start_redis, url_for
from coordinator.state.metadata import Metadata
from coordinator.state.reconcile import Held, plan, plan_reconnected
from coordinator.state.requests import IN_PROCESS_GATHER, IN_PROCESS_STORE
from coordinator.state.versions import ABORTED
from smoltorrent import defaults


@pytest.fixture
def md(tmp_path):
    pid, port = start_redis(tmp_path / "redis")
    yield Metadata(url_for(tmp_path / "redis", port))
    os.kill(pid, signal.SIGTERM)


def _pending(md, tmp_path, seed: int, host: str, request_id: str):
    """A pending version of `host`'s store request `request_id`: two shards, two copies."""
    path = tmp_path / f"ckpt-{seed}.safetensors"
    write_checkpoint(path, 200_000 + seed, hidden=32)
    free = {"node-a": 10**12, "node-b": 10**12}
    p = prepare_store(path, path.name, free, replicas=2, shards=2)
    fields = {"host": host, "request_id": request_id}
    assert md.versions.create_pending(p.manifest, p.vkey, fields, list(p.targets)) == "created"
    return p


def test_only_what_no_live_task_holds_is_sent_again(md, tmp_path):
    mine = _pending(md, tmp_path, 1, "h1", "r1")
    other_host = _pending(md, tmp_path, 2, "h2", "r2")
    digest = mine.manifest.entries[0].blob_sha256
    md.transfers.settle(mine.vkey, 0, 0, mine.targets[0][0], digest)

    nothing_held = plan_reconnected(md, "h1", Held())
    assert nothing_held.transfers == [mine.vkey] and nothing_held.busy == {mine.vkey: set()}
    assert other_host.vkey not in nothing_held.transfers

    # A live chain task moves shard 0: only shard 1 goes again.
    one_held = plan_reconnected(md, "h1", Held(shards=frozenset({(mine.vkey, 0)})))
    assert one_held.transfers == [mine.vkey] and one_held.busy == {mine.vkey: {0}}

    # Every open shard is held, or the store task that sends them still runs: nothing.
    all_held = Held(shards=frozenset({(mine.vkey, 0), (mine.vkey, 1)}))
    assert plan_reconnected(md, "h1", all_held).transfers == []
    assert plan_reconnected(md, "h1", Held(requests=frozenset({"r1"}))).transfers == []


def test_a_complete_barrier_gets_its_commit_unless_one_is_held(md, tmp_path):
    p = _pending(md, tmp_path, 3, "h1", "r3")
    for shard, nodes in enumerate(p.targets):
        for replica, node in enumerate(nodes):
            md.transfers.settle(p.vkey, shard, replica, node, p.manifest.entries[shard].blob_sha256)
    assert plan_reconnected(md, "h1", Held()).commits == [p.vkey]
    assert plan_reconnected(md, "h1", Held(commits=frozenset({p.vkey}))).commits == []


def test_open_requests_go_again_unless_their_task_is_held(md, tmp_path):
    md.requests.open_request("q1", "store", "h1", {"path": "/x", "name": "x"})
    md.requests.open_request("q2", "gather", "h1", {"vkey": "v", "out": "/y"})
    md.requests.open_request("q3", "store", "h2", {"path": "/z", "name": "z"})
    actions = plan_reconnected(md, "h1", Held(requests=frozenset({"q2"})))
    assert [rid for rid, _ in actions.requests] == ["q1"]


def test_a_gather_or_store_its_own_process_runs_is_never_sent_to_a_worker(md):
    """A reader's gather, or a store a rank on a host with no worker runs (tasks/
    requests.py), is open while its process runs it; a worker starting on that host, or
    one whose broker connection came back, sends nothing for it (it would write the file
    a second time, or refuse the path; store the same file twice at once)."""
    md.requests.open_request("r-here", IN_PROCESS_GATHER, "h1", {"vkey": "v", "out": "/srv/x"})
    md.requests.start_request("r-here", "process:h1:4242")
    store = {"path": "/srv/p", "name": "p", "replicas": 2, "shards": None}
    md.requests.open_request("s-here", IN_PROCESS_STORE, "h1", store)
    md.requests.start_request("s-here", "boot-of-the-rank", "boot-of-the-rank:4243")
    md.requests.open_request("r-task", "gather", "h1", {"vkey": "v", "out": "/srv/y"})
    started = plan(md, 0.0, grace=0, stale_after=None, deadline=1e9, started_host="h1")
    assert [rid for rid, _ in started.requests] == ["r-task"]
    assert [rid for rid, _ in plan_reconnected(md, "h1", Held()).requests] == ["r-task"]


def test_a_version_pending_past_the_deadline_is_aborted_unless_its_barrier_is_complete(
    md, tmp_path
):
    """docs/how-it-works.md: reconcile aborts a version still pending PENDING_DEADLINE_S
    (a week) after it was created, saying to store it again; not a second before, and
    never one whose every copy settled (that one is committed)."""
    stuck = _pending(md, tmp_path, 4, "h1", "r4")
    done = _pending(md, tmp_path, 5, "h1", "r5")
    for shard, nodes in enumerate(done.targets):
        for replica, node in enumerate(nodes):
            digest = done.manifest.entries[shard].blob_sha256
            md.transfers.settle(done.vkey, shard, replica, node, digest)
    md.transfers.mark_commit_enqueued(done.vkey)
    created = float(md.versions.version(stuck.vkey)["created_at"])
    deadline = defaults.PENDING_DEADLINE_S

    def decided(now: float):
        return plan(md, now, grace=3600, stale_after=lambda *_: 1e12, deadline=deadline)

    assert decided(created + deadline - 1).aborts == []
    late = decided(created + deadline + 1)
    assert [vkey for vkey, _ in late.aborts] == [stuck.vkey]
    assert "store it again" in late.aborts[0][1]
    assert late.commits == [done.vkey]  # past its grace too: its commit goes again
    md.versions.abort(*late.aborts[0])
    assert md.versions.version(stuck.vkey)["state"] == ABORTED
