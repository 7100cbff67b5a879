"""smoltorrent.load(name, tensors=[...]) on a real cluster: only the selected tensors'
bytes leave the nodes, verified per tensor, a bad copy falls back to its replica.

These store whole shards (schema 2, chunks=False), where a partial load reads tensor by
tensor; a chunked version's partial load reads whole chunks (tests/tasks/test_chunked_store.py)."""

from __future__ import annotations

from coordinator.plan.read_order import read_order
from coordinator.plan.selection import select
from coordinator.state import redis_keys as K
from tests.nodeproc import bytes_sent

SAVE = """
import json
import smoltorrent
from tests.checkpoints import llm_like_tensors

sd = llm_like_tensors(layers=6, hidden=64)
saved = smoltorrent.save(sd, "api/partial.safetensors")
print(json.dumps({"version_id": saved.version_id}))
"""

LOAD = """
import json
import smoltorrent
import torch
from tests.checkpoints import llm_like_tensors

sd = llm_like_tensors(layers=6, hidden=64)
back = smoltorrent.load("api/partial.safetensors", tensors={patterns!r}, framework={framework!r})
def raw(t):
    if {framework!r} == "torch":
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return t.tobytes()
want = {{k: v for k, v in sd.items() if k in back}}
print(json.dumps({{
    "names": sorted(back),
    "same_bits": all(raw(back[k]) == want[k].contiguous().reshape(-1).view(torch.uint8)
                     .numpy().tobytes() for k in back),
    "bytes": sum(v.numel() * v.element_size() for v in want.values()),
}}))
"""


def test_a_partial_load_moves_only_the_selected_bytes(make_cluster, api_session):
    c = make_cluster(4, chunks=False, SMOLTORRENT_METRICS_PORT="0")
    api = api_session(c)  # the save and both loads in one API process (one import of torch)
    api.run(SAVE)
    before = bytes_sent(c.node_procs)
    patterns = ["model.layers.3.*", "lm_head.*"]
    out = api.run(LOAD.format(patterns=patterns, framework="torch"))
    moved = bytes_sent(c.node_procs) - before
    assert out["same_bits"]
    assert out["names"] and all(
        n.startswith("model.layers.3.") or n.startswith("lm_head.") for n in out["names"]
    )
    assert len(out["names"]) == 9  # eight per layer, and the int8 head
    assert moved == out["bytes"]  # counted by the nodes themselves

    before = bytes_sent(c.node_procs)
    out = api.run(LOAD.format(patterns=["model.norm.weight"], framework="numpy"))
    assert out["names"] == ["model.norm.weight"] and out["same_bits"]
    assert bytes_sent(c.node_procs) - before == out["bytes"] == 64 * 4


def test_bad_bytes_under_a_selected_tensor_fall_back_to_the_replica(make_cluster, api_session):
    c = make_cluster(3, chunks=False, SMOLTORRENT_METRICS_PORT="0")
    api = api_session(c)  # the save and the load in one API process (one import of torch)
    api.run(SAVE)
    md = c.md
    name = "model.layers.4.mlp.up_proj.weight"
    manifest = md.versions.manifest(md.versions.current("api/partial.safetensors"))
    index, shard = next((i, s) for i, s in enumerate(manifest.shards) if name in s.tensors)
    # The replica the gather tries first (plan/read_order, as the gather task asks it).
    holders = [md.blobs.placement(s.blob_sha256) for s in manifest.shards]
    sizes = [s.blob_size for s in manifest.shards]
    first = read_order(holders, sizes, md.nodes.alive(md.nodes.nodes()))[index][0]
    node = next(n for n in c.node_procs if n.client().ping() == first)
    blob = node.data_dir / "blobs" / shard.blob_sha256[:2] / shard.blob_sha256
    data = bytearray(blob.read_bytes())
    (piece,) = select(manifest, [name]).reads[0].pieces
    start = piece.blob_offset
    data[start + 3] ^= 0x10
    blob.write_bytes(bytes(data))
    out = api.run(LOAD.format(patterns=[name], framework="torch"))
    assert out["names"] == [name] and out["same_bits"]
    # The corrupt copy went on record for repair (gone from it once its at-once check ran).
    assert md.r.hexists(K.BAD_COPIES, f"{shard.blob_sha256}:{first}") or (
        f"bad-copy-{shard.blob_sha256}-{first}" in c.worker_log()
    )
