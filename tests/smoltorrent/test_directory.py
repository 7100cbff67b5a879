"""A Hugging Face checkpoint directory (safetensors files and their index) as one unit:
`smoltorrent store DIR`, `gather` back to a directory, `smoltorrent.load` as one dict."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from coordinator.state import redis_keys as K
from coordinator.state.requests import IN_PROCESS_GATHER
from tests import held_cli
from tests.checkpoints import write_hf_dir
from tests.smoltorrent.conftest import run_api
from tests.tasks.conftest import wait_until


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
    # Each file is a checkpoint of its own, listed and shown as any other. The directory's
    # own record (no tensors) is one too, so the nodes keep the unit, but `ls` hides it
    # unless it is named exactly.
    listed = {r["name"] for r in c.cli_json("ls") if r["state"] == "committed"}
    files = {f"hf/llama-tiny/{f}" for f in stored["files"]}
    assert listed == files
    record = c.cli_json("ls", "hf/llama-tiny/.directory.safetensors")
    assert [r["state"] for r in record] == ["committed"]

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
    c.cli("rm", "hf/llama-tiny", "--yes")
    assert not [r for r in c.cli_json("ls") if r["name"].startswith("hf/llama-tiny/")]
    gone = c.cli("gather", "hf/llama-tiny", "-o", str(tmp_path / "gone"), check=False)
    assert gone.returncode == 1 and "hf/llama-tiny" in gone.stderr


def test_the_directory_store_accepted_last_is_current_whichever_finishes_first(
    make_cluster, tmp_path
):
    """Directory A's store is accepted, then held (its command SIGSTOPped once its files
    are recorded) while B's store of the same name runs to its end; A finishes last. The
    name serves B, its latest accepted request: it served A, the last to write its record
    (a plain HSET)."""
    c = make_cluster(3)
    a, b = tmp_path / "a", tmp_path / "b"
    write_hf_dir(a, seed=1)
    write_hf_dir(b, seed=2)
    store_a = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "store", str(a), "--name", "d", "--json"],
        env=c.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: len(file_requests(c, "d/")) >= 3, timeout=60, what="A's files recorded")
        store_a.send_signal(signal.SIGSTOP)
        b_row = c.cli_json("store", str(b), "--name", "d")
    finally:
        store_a.send_signal(signal.SIGCONT)
    out, err = store_a.communicate(timeout=120)
    assert store_a.returncode == 0, err
    a_row = json.loads(out)
    assert a_row["version_id"] != b_row["version_id"]
    gathered = tmp_path / "out"
    assert c.cli_json("gather", "d", "-o", str(gathered))["version_id"] == b_row["version_id"]
    assert digests(gathered) == {k: v for k, v in digests(b).items() if k != "config.json"}


@pytest.mark.parametrize("kind", [IN_PROCESS_GATHER, "gather"])
def test_a_directory_gather_killed_mid_way_leaves_no_temp_directory_once_gathered_again(
    make_cluster, tmp_path, kind
):
    """A directory gather SIGKILLed (no handler runs) once every file is in its temp
    directory, before the index and the rename: that directory, as big as the checkpoint,
    stayed beside the destination for good. The next gather into the same destination
    removes it and writes the directory whole. Its files gathered by the command itself
    and by the worker (which writes into SMOLTORRENT_GATHER_DIRS only)."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    c = make_cluster(3, SMOLTORRENT_GATHER_DIRS=str(allowed))
    src = tmp_path / "src"
    write_hf_dir(src)
    stored = c.cli_json("store", str(src), "--name", "d")
    parent = tmp_path if kind == IN_PROCESS_GATHER else allowed
    out = parent / "out"

    def partials() -> list[Path]:
        return [p for p in parent.iterdir() if p.name.startswith(".out.")]

    gather = held_cli.start(
        c.env(), "smoltorrent.durable:write_file", "gather", "d", "-o", str(out), "--json"
    )
    try:
        held_cli.wait_stopped(gather)  # as it writes the index, every file gathered
        [partial] = partials()
        assert sorted(p.name for p in partial.iterdir()) == sorted(stored["files"])
        assert {r["kind"] for r in gather_requests(c)} == {kind}
    finally:
        gather.kill()
        gather.wait()
    assert partials() == [partial] and not out.exists()

    again = c.cli_json("gather", "d", "-o", str(out))
    assert again["version_id"] == stored["version_id"]
    assert digests(out) == {k: v for k, v in digests(src).items() if k != "config.json"}
    assert partials() == []


def gather_requests(c) -> list[dict]:
    """Every gather request recorded, run by the worker or in process."""
    found = []
    for key in c.md.r.scan_iter(K.REQUEST.format(rid="*")):
        record = c.md.r.hgetall(key)
        if record.get("kind") in ("gather", IN_PROCESS_GATHER):
            found.append(record)
    return found


def file_requests(c, prefix: str) -> list[dict]:
    """Every store request recorded for a checkpoint name under `prefix`."""
    found = []
    for key in c.md.r.scan_iter(K.REQUEST.format(rid="*")):
        record = c.md.r.hgetall(key)
        if record.get("kind") == "store" and json.loads(record["args"])["name"].startswith(prefix):
            found.append(record)
    return found


def tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every regular file under `root`: its SHA-256 and permission bits, by relative path."""
    return {
        str(f.relative_to(root)): (
            hashlib.sha256(f.read_bytes()).hexdigest(),
            f.stat().st_mode & 0o777,
        )
        for f in sorted(root.rglob("*"))
        if f.is_file() and not f.is_symlink()
    }


def test_every_file_of_a_directory_comes_back_byte_for_byte_with_all_files(make_cluster, tmp_path):
    """store DIR --all-files keeps the files that are not safetensors (pickles included,
    never parsed) in NAME/.files.safetensors, and gather writes each back byte for byte
    with its permission bits, folders, an empty file and all; a link is not followed. The
    default still stores only the safetensors files and the index."""
    c = make_cluster(3)
    src = tmp_path / "checkpoint-3"
    weight_map = write_hf_dir(src, parts=2)
    (src / "optimizer.pt").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 40)  # a zip
    (src / "rng_state.pth").write_bytes(b"\x80\x02" + b"\x00" * 10)  # a pickle
    (src / "empty.txt").write_bytes(b"")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o750)
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "sub" / "deeper" / "notes.bin").write_bytes(b"\x01" * 3000)
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    (src / "link.txt").symlink_to(secret)
    (src / "sub" / "outside").symlink_to(tmp_path)

    plain = c.cli_json("store", str(src), "--name", "plain")
    assert plain["kept_files"] == [] and "optimizer.pt" in plain["ignored"]
    stored = c.cli_json("store", str(src), "--name", "hf/run/checkpoint-3", "--all-files")
    assert stored["kept_files"] == [
        "config.json", "empty.txt", "optimizer.pt", "rng_state.pth", "run.sh",
        "sub/deeper/notes.bin",
    ]  # fmt: skip
    assert stored["ignored"] == ["link.txt", "sub/outside"]
    assert ".files.safetensors" in stored["files"]

    out = tmp_path / "out"
    c.cli_json("gather", "hf/run/checkpoint-3", "-o", str(out))
    want = {k: v for k, v in tree(src).items() if k not in ("link.txt",)}
    assert tree(out) == want
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in src.iterdir() if p.name != "link.txt"
    )  # no pack left behind, no link
    # load() merges the safetensors files' tensors, not the pack's.
    loaded = run_api(
        c,
        """
        import json
        import smoltorrent
        state = smoltorrent.load("hf/run/checkpoint-3", framework="numpy")
        print(json.dumps(sorted(state)))
        """,
    )
    assert loaded == sorted(weight_map)
    # Stored again: nothing new, the same version.
    again = c.cli_json("store", str(src), "--name", "hf/run/checkpoint-3", "--all-files")
    assert (again["version_id"], again["new_files"]) == (stored["version_id"], [])


def test_ls_lists_a_directorys_files_but_not_its_pack_of_other_files(make_cluster, tmp_path):
    """A directory stored with --all-files (a Trainer's checkpoint-N): `ls`, `ls PREFIX/`
    and `ls NAME`, as a table and as --json alike, list its safetensors files; its pack of
    other files (NAME/.files.safetensors) is internal, as its record is, and is listed
    only when named exactly."""
    c = make_cluster(2)
    src = tmp_path / "checkpoint-3"
    write_hf_dir(src, parts=2)
    (src / "optimizer.pt").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    name = "hf/run/checkpoint-3"
    stored = c.cli_json("store", str(src), "--name", name, "--all-files")
    files = {f"{name}/{f}" for f in stored["files"] if f.endswith("-of-00002.safetensors")}
    assert len(files) == 2
    for where in ([], ["hf/run/"], [name]):
        assert {r["name"] for r in c.cli_json("ls", *where)} == files
        table = c.cli("ls", *where).stdout  # a pipe: every row whole, never cut
        assert sum(f in table for f in files) == 2
        assert ".files.safetensors" not in table and ".directory.safetensors" not in table
    pack = c.cli_json("ls", f"{name}/.files.safetensors")
    assert [r["state"] for r in pack] == ["committed"]


def hostile_pack(path: Path, names: list[str]) -> None:
    """A pack as smoltorrent writes one, listing `names` (its paths planted)."""
    data = b"owned\n"
    header = {n: {"dtype": "U8", "shape": [len(data)], "data_offsets": [i * 6, i * 6 + 6]}
              for i, n in enumerate(names)}  # fmt: skip
    header["__metadata__"] = {"smoltorrent.files": json.dumps(dict.fromkeys(names, 0o644))}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data * len(names))


PLANTED = [
    ["../escaped"],
    ["/tmp/escaped"],
    ["sub/../../escaped"],
    ["a", "a/b"],
    ["model.safetensors"],
]


def test_a_planted_path_in_a_directorys_pack_is_refused_and_nothing_is_written(
    make_cluster, tmp_path
):
    """A pack whose file list escapes the output (absolute, '..'), makes a file a folder,
    or replaces a member is refused before a byte is written: the gather fails naming it,
    the output does not exist, and nothing appears outside it. The pack is planted as the
    directory's own file of that name, stored without --all-files (so as it is)."""
    c = make_cluster(2)
    for i, names in enumerate(PLANTED):
        src = tmp_path / f"src{i}"
        src.mkdir()
        save_file({"w": np.zeros(4, np.float32)}, str(src / "model.safetensors"))
        hostile_pack(src / ".files.safetensors", names)
        if i == 0:
            refused = c.cli("store", str(src), "--name", "evil", "--all-files", check=False)
            assert refused.returncode == 2 and "rename the file" in refused.stderr
        c.cli_json("store", str(src), "--name", f"evil{i}")
        out = tmp_path / f"out{i}" / "inner"
        out.parent.mkdir()
        gathered = c.cli("gather", f"evil{i}", "-o", str(out), check=False)
        assert gathered.returncode != 0 and "not written by smoltorrent" in gathered.stderr, names
        assert not out.exists() and list(out.parent.iterdir()) == []
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/escaped").exists()
