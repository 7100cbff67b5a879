"""The boot sequence at worker start: file_sync -> checksum_sync of what was in flight ->
resume transfers -> crosscheck, so a restart re-sends nothing a node already holds."""

from __future__ import annotations

import json
import urllib.request

from coordinator.dataplane.node_client import NodeClient
from coordinator.dataplane.store_engine import prepare_store, store_checkpoint
from coordinator.state.versions import COMMITTED
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt, sha


def puts(node) -> int:
    """Put requests the node has served, plain or in a chain (its own counter, from its
    /metrics): each is one copy received."""
    port = (node.data_dir / "metrics_port").read_text().strip()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        lines = page.read().decode().splitlines()
    found = [x for x in lines if x.startswith("smoltorrent_node_request_seconds_count")]
    ops = ('op="put"', 'op="chain_put"')
    return sum(int(float(x.split()[-1])) for x in found if any(op in x for op in ops))


def left_mid_store(c, src, lost_shard: int):
    """A pending version as a worker SIGKILLed mid-store leaves it: every shard's copies
    stored and verified on their nodes but none settled (each transfer died before its
    settle), except `lost_shard`, whose copies were never sent. (vkey, plan)"""
    md = c.md
    result = store_checkpoint(src, [n.address for n in c.node_procs], shards=3)
    manifest = result.manifest
    targets = [tuple(result.holders[i]) for i in range(len(manifest.entries))]
    by_id = {NodeClient(n.address).ping(): n for n in c.node_procs}
    for node_id in targets[lost_shard]:
        NodeClient(by_id[node_id].address).delete(manifest.entries[lost_shard].blob_sha256)
    identity = prepare_store(src, src.name, {n: 10**12 for n in md.nodes.nodes()}).identity
    vkey = manifest.storage_key()
    fields = {"path": str(src), "host": c.host_id, "identity": json.dumps(identity.to_dict())}
    assert md.versions.create_pending(manifest, vkey, fields, targets) == "created"
    return vkey, targets


def test_a_restarted_worker_sends_only_the_shards_no_node_holds(make_cluster, tmp_path):
    c = make_cluster(3, SMOLTORRENT_METRICS_PORT="0")
    src = make_ckpt(tmp_path / "b.safetensors")
    c.kill_worker()
    vkey, targets = left_mid_store(c, src, lost_shard=1)
    before = sum(puts(n) for n in c.node_procs)
    c.start_worker()
    wait_until(lambda: c.md.versions.state(vkey) == COMMITTED, timeout=120, what="the commit")
    # The copies already on their nodes were re-hashed there and settled, never put again:
    # the only puts are the lost shard's replicas.
    assert sum(puts(n) for n in c.node_procs) - before == len(targets[1])
    assert "boot of" in c.worker_log()
    out = tmp_path / "out.safetensors"
    c.cli("gather", "b.safetensors", "-o", str(out))
    assert sha(out) == sha(src)
