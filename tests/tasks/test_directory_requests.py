"""A directory checkpoint's file names and index name come from Redis, or from a node's
manifest in a rebuild: each must be one path component before a gather writes it
(tasks/directory_requests.py, coordinator/plan/directory.py)."""

from __future__ import annotations

import json
import os
import struct
import time

from coordinator.plan.directory import DIRECTORY_KEY, FILES_KEY, INDEX_KEY, INDEX_NAME_KEY
from coordinator.plan.safetensors_header import METADATA_KEY
from coordinator.state import redis_keys as K
from tests.checkpoints import write_hf_dir


def stored_directory(c, tmp_path, name: str) -> dict:
    src = tmp_path / "llama-tiny"
    write_hf_dir(src)
    return c.cli_json("store", str(src), "--name", name)


def test_names_planted_in_the_redis_record_are_never_written_outside_the_output(
    make_cluster, tmp_path
):
    """The directory's record in Redis changed by hand: its index named an absolute path,
    a file '../escaped.safetensors'. The gather wrote the index there and the file beside
    the output; now it refuses the record and writes nothing."""
    c = make_cluster(2)
    stored = stored_directory(c, tmp_path, "hf/planted")
    key = K.DIRECTORY.format(name="hf/planted")
    field = f"version:{stored['version_id']}"
    record = json.loads(c.md.r.hget(key, field))
    victim = tmp_path / "victim"
    victim.mkdir()
    record["index_name"] = str(victim / "bashrc")
    first = sorted(record["files"])[0]
    record["files"]["../escaped.safetensors"] = record["files"].pop(first)
    c.md.r.hset(key, field, json.dumps(record))

    out = tmp_path / "out"
    gathered = c.cli("gather", "hf/planted", "-o", str(out), check=False)
    assert not (victim / "bashrc").exists()
    assert not (tmp_path / "escaped.safetensors").exists()
    assert gathered.returncode == 1, gathered.stdout
    assert "is not one file name" in gathered.stderr, gathered.stderr
    assert not out.exists()


def record_file(path, name: str, files: dict[str, str], index_name: str) -> None:
    """A directory's record checkpoint (no tensors, the unit in its header metadata) as
    record_bytes writes one, with whatever names it is given."""
    metadata = {
        DIRECTORY_KEY: name,
        FILES_KEY: json.dumps(files, sort_keys=True, separators=(",", ":")),
        INDEX_NAME_KEY: index_name,
        INDEX_KEY: '{"weight_map": {}}',
    }
    raw = json.dumps({METADATA_KEY: metadata}, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    past = time.time() - 60
    os.utime(path, (past, past))


def test_an_index_name_in_a_nodes_record_is_refused_by_the_rebuild(make_cluster, tmp_path):
    """A record whose index name is an absolute path stored as the directory's current
    record (what a node's copy of the manifest holds), then Redis lost: the rebuild
    restored the directory and its gather wrote the index at that path. The rebuild now
    skips the record."""
    c = make_cluster(2)
    stored = stored_directory(c, tmp_path, "hf/rebuilt")
    victim = tmp_path / "victim"
    victim.mkdir()
    crafted = tmp_path / "record.safetensors"
    record_file(crafted, "hf/rebuilt", stored["files"], str(victim / "bashrc"))
    c.cli("store", str(crafted), "--name", "hf/rebuilt/.directory.safetensors")

    c.md.r.flushall()
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    out = tmp_path / "out"
    c.cli("gather", "hf/rebuilt", "-o", str(out), check=False)
    assert not (victim / "bashrc").exists()
    assert summary["directories"] == 0
