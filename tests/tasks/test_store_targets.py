"""What the store task holds: its per-entry targets (held through the task, so shared, not
copied), and no child per chain task it sends."""

from __future__ import annotations

import json
import os
import time

from coordinator.local.synthetic import write_checkpoint
from coordinator.state import redis_keys as K
from coordinator.state.versions import COMMITTED
from tasks.store import shared_targets


def test_entries_with_the_same_node_order_share_one_tuple():
    chunks = [["b", "a"], ("a", "b"), ["b", "a"], ("c",), ["a", "b"], ("c",)] * 1000
    targets = shared_targets(iter(chunks))
    assert targets == [tuple(t) for t in chunks]
    assert len({id(t) for t in targets}) == 3  # ("b", "a"), ("a", "b"), ("c",)


def test_a_store_keeps_no_child_per_chain_task_it_sends(make_cluster, tmp_path):
    """Issue 25: Celery kept an AsyncResult per chain task a store sent (252 for a 16 GB
    checkpoint) in the task's request, and their ids in its result; nothing reads them."""
    c = make_cluster()
    src = tmp_path / "model.safetensors"
    write_checkpoint(src, 3_000_000, hidden=64)
    past = time.time() - 60
    os.utime(src, (past, past))
    assert c.cli_json("store", str(src), "--name", "m")["state"] == COMMITTED
    metas = [json.loads(c.md.r.get(k)) for k in c.md.r.scan_iter("celery-task-meta-*")]
    stores = [m for m in metas if m.get("name") == "smoltorrent.store"]
    assert stores and all(m["children"] == [] for m in stores)
    assert c.md.r.hlen(K.PLAN.format(vkey=c.md.versions.current("m")))  # it sent its chunks
