"""A Hugging Face checkpoint directory (safetensors files and their index) as one unit:
`smoltorrent store DIR`, `gather` back to a directory, `smoltorrent.load` as one dict."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.checkpoints import write_hf_dir
from tests.smoltorrent.conftest import run_api


def digests(root: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(root.iterdir())}


def test_a_directory_with_an_hf_index_round_trips(make_cluster, tmp_path):
    c = make_cluster(3)
    src = tmp_path / "llama-tiny"
    weight_map = write_hf_dir(src)
    stored = c.cli_json("store", str(src), "--name", "hf/llama-tiny")
    assert stored["index"] == "model.safetensors.index.json"
    assert len(stored["files"]) == 3 and stored["ignored"] == ["config.json"]
    assert sorted(stored["new_files"]) == sorted(stored["files"])
    # Each file is a checkpoint of its own, listed and shown as any other.
    # The directory's own record (no tensors) is one too: the nodes keep the unit.
    listed = {r["name"] for r in c.cli_json("ls") if r["state"] == "committed"}
    files = {f"hf/llama-tiny/{f}" for f in stored["files"]}
    assert listed == files | {"hf/llama-tiny/.directory.safetensors"}

    out = tmp_path / "restored"
    report = c.cli_json("gather", "hf/llama-tiny", "-o", str(out))
    assert report["version_id"] == stored["version_id"]
    want = {k: v for k, v in digests(src).items() if k != "config.json"}
    assert digests(out) == want  # every file and the index, byte for byte
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    refused = c.cli("gather", "hf/llama-tiny", "-o", str(out), check=False)
    assert refused.returncode == 1 and "not an empty directory" in refused.stderr

    # Redis lost: rebuild brings the directory back from the nodes' manifests.
    c.md.r.flushall()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert summary["directories"] == 1
    again_out = tmp_path / "after-rebuild"
    assert (
        c.cli_json("gather", "hf/llama-tiny", "-o", str(again_out))["version_id"]
        == (stored["version_id"])
    )
    assert digests(again_out) == want

    # Storing it again moves nothing and keeps the version.
    again = c.cli_json("store", str(src), "--name", "hf/llama-tiny")
    assert again["version_id"] == stored["version_id"] and again["new_files"] == []

    loaded = run_api(
        c,
        """
        import json
        import torch
        import smoltorrent
        from tests.checkpoints import llm_like_tensors

        def raw(t):
            return t.contiguous().reshape(-1).view(torch.uint8).tolist()

        want = llm_like_tensors(layers=3, hidden=32, seed=0)
        whole = smoltorrent.load("hf/llama-tiny")
        some = smoltorrent.load("hf/llama-tiny", tensors=["model.layers.1.*"])
        print(json.dumps({
            "whole": sorted(whole) == sorted(want)
                and all(raw(whole[k]) == raw(want[k]) for k in want),
            "some": sorted(some),
        }))
        """,
    )
    assert loaded["whole"]
    assert loaded["some"] == sorted(n for n in weight_map if n.startswith("model.layers.1."))

    # rm of the directory removes every file's versions and its record, then the unit.
    c.cli("rm", "hf/llama-tiny")
    assert not [r for r in c.cli_json("ls") if r["name"].startswith("hf/llama-tiny/")]
    gone = c.cli("gather", "hf/llama-tiny", "-o", str(tmp_path / "gone"), check=False)
    assert gone.returncode == 1 and "hf/llama-tiny" in gone.stderr
