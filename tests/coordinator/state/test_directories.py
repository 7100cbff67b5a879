"""Directory checkpoints in Redis (coordinator/state/directories.py): a record holds only
file names that are one path component and version keys, when it is written and when it
is read back."""

from __future__ import annotations

import json

import pytest

from coordinator.plan.version_ids import storage_key
from coordinator.state import redis_keys as K
from coordinator.state.directories import Directories, DirectoryVersion, Member
from smoltorrent.errors import UnsafeNameError


def version(files: dict[str, str], index_name: str | None = "m.safetensors.index.json"):
    members = {f: Member(f"hf/m/{f}", storage_key(f"hf/m/{f}", v), v, 10) for f, v in files.items()}
    return DirectoryVersion("hf/m", "9" * 64, members, index_name, b"{}", 1.0)


def test_a_record_read_back_with_a_planted_name_is_refused(md):
    directories = Directories(md.r)
    assert directories.commit(version({"a.safetensors": "1" * 64}), md.requests.next_seq())
    assert set(directories.get("hf/m").files) == {"a.safetensors"}
    key, field = K.DIRECTORY.format(name="hf/m"), "version:" + "9" * 64
    for edit in (
        lambda r: r.update(index_name="/home/u/.bashrc"),
        lambda r: r["files"].update({"../x": r["files"].pop("a.safetensors")}),
        lambda r: r["files"]["a.safetensors"].update(vkey="../../spool"),
    ):
        record = json.loads(md.r.hget(key, field))
        edit(record)
        md.r.hset(key, field, json.dumps(record))
        with pytest.raises(UnsafeNameError):
            directories.get("hf/m")
        md.r.delete(key)
        directories.commit(version({"a.safetensors": "1" * 64}), md.requests.next_seq())


def test_a_record_with_such_a_name_is_never_made():
    with pytest.raises(UnsafeNameError):
        version({"../x.safetensors": "1" * 64})
    with pytest.raises(UnsafeNameError):
        version({"a.safetensors": "1" * 64}, index_name="../../x")
