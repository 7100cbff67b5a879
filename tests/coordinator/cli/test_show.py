"""`smoltorrent ls NAME` and `smoltorrent show NAME` through the real CLI on a real cluster:
a name's versions, and a version's header read from its manifest, no tensor byte moved."""

from __future__ import annotations

import os
import time
from pathlib import Path

from safetensors.torch import load_file

from coordinator.plan.selection import select
from tests.checkpoints import LLM_METADATA, write_llm_like
from tests.nodeproc import bytes_sent


def settled(path: Path) -> Path:
    past = time.time() - 60  # old enough that the store does not wait for the file to settle
    os.utime(path, (past, past))
    return path


def test_ls_name_lists_its_versions_and_show_reads_only_the_manifest(make_cluster, tmp_path):
    c = make_cluster(3, SMOLTORRENT_METRICS_PORT="0")
    src = tmp_path / "a.safetensors"
    first = write_llm_like(src, layers=2, hidden=32)
    old = c.cli_json("store", str(settled(src)), "--name", "run/latest.safetensors")
    second = write_llm_like(src, layers=3, hidden=32, seed=1)
    new = c.cli_json("store", str(settled(src)), "--name", "run/latest.safetensors")
    other = tmp_path / "b.safetensors"
    write_llm_like(other, layers=1, hidden=16)
    c.cli_json("store", str(settled(other)), "--name", "run/other.safetensors")

    rows = c.cli_json("ls", "run/latest.safetensors")
    assert [r["version_id"] for r in rows] == [old["version_id"], new["version_id"]]
    assert [r["current"] for r in rows] == [False, True]
    assert [r["state"] for r in rows] == ["committed", "committed"]
    assert rows[0]["tensors"] == len(first) and rows[1]["tensors"] == len(second)
    text = c.cli("ls", "run/latest.safetensors").stdout.splitlines()
    assert text[0].split("\t")[:5] == ["version", "current", "state", "tensors", "size"]
    assert text[2].split("\t")[:2] == [new["version_id"][:12], "*"]
    assert text[1].split("\t")[1] == ""
    assert all("run/other" not in line for line in text)

    sent_before = bytes_sent(c.node_procs)
    shown = c.cli_json("show", "run/latest.safetensors", "--version", old["version_id"][:10],
                       "--tensors")  # fmt: skip
    assert shown["version_id"] == old["version_id"] and shown["current"] is False
    assert shown["metadata"] == LLM_METADATA
    assert shown["tensor_count"] == len(first)
    by_name = {t["name"]: t for t in shown["tensors"]}
    assert set(by_name) == set(first)
    for name, tensor in first.items():
        dtype = {"torch.bfloat16": "BF16", "torch.float8_e4m3fn": "F8_E4M3"}.get(str(tensor.dtype))
        assert by_name[name]["shape"] == list(tensor.shape)
        assert dtype is None or by_name[name]["dtype"] == dtype
    assert sum(shown["dtypes"].values()) == len(first)
    assert shown["size"] == old["size"]

    summary = c.cli_json("show", "run/latest.safetensors")
    assert summary["version_id"] == new["version_id"] and "tensors" not in summary
    plain = c.cli("show", "run/latest.safetensors", "--tensors").stdout
    assert "metadata step: 100" in plain
    assert "model.layers.2.mlp.up_proj.weight\tBF16\t64x32\t" in plain
    # Nothing was read from a node: the header comes from the manifest alone.
    assert bytes_sent(c.node_procs) == sent_before

    # gather --tensors: a file of the selected tensors, only their bytes read.
    out = tmp_path / "layer2.safetensors"
    report = c.cli_json("gather", "run/latest.safetensors", "-o", str(out), "--tensors",
                        "model.layers.2.*")  # fmt: skip
    back = load_file(out)
    assert set(back) == {n for n in second if n.startswith("model.layers.2.")}
    selected = sum(t.numel() * t.element_size() for n, t in second.items() if n in back)
    assert report["tensor_bytes"] == selected
    # Only blobs holding a selected byte are read: from a shard those tensors' bytes, a
    # chunk whole (its blob, as stored: what bytes_fetched and the nodes count alike).
    manifest = c.md.versions.manifest(c.md.versions.current("run/latest.safetensors"))
    read = [manifest.entries[r.shard] for r in select(manifest, ["model.layers.2.*"]).reads]
    if manifest.chunked:
        assert report["bytes_fetched"] == sum(e.blob_size for e in read)
        assert bytes_sent(c.node_procs) - sent_before == report["bytes_fetched"]
    else:
        assert bytes_sent(c.node_procs) - sent_before == report["bytes_fetched"] == selected


def test_ls_and_show_of_an_unknown_name_say_so(make_cluster):
    c = make_cluster(1, worker=False)
    for argv in (("ls", "nope"), ("show", "nope")):
        result = c.cli(*argv, check=False)
        assert result.returncode == 1
        assert "nope" in result.stderr and "smoltorrent ls" in result.stderr
