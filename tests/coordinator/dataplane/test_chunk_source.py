"""The spool's paths (coordinator/dataplane/chunk_source.py): made of a checked version key
and a chunk's index, never of a path a message or Redis holds."""

from __future__ import annotations

import pytest

from coordinator.dataplane.chunk_source import release, spool_dir
from coordinator.plan.blob_spans import BlobSpan
from coordinator.plan.version_ids import storage_key
from smoltorrent.errors import UnsafeNameError


def test_a_spool_directory_is_named_only_by_a_version_key(tmp_path):
    vkey = storage_key("a.safetensors", "0" * 64)
    assert spool_dir(tmp_path, vkey) == str(tmp_path / vkey)
    for bad in ("/home/u", "..", str(tmp_path), vkey[:-1] + "/"):
        with pytest.raises(UnsafeNameError):
            spool_dir(tmp_path, bad)


def test_release_removes_the_chunk_in_its_spool_not_the_path_the_span_names(tmp_path):
    spool = tmp_path / "spool" / storage_key("a.safetensors", "0" * 64)
    spool.mkdir(parents=True)
    (spool / "3.chunk").write_bytes(b"encoded")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "file").write_bytes(b"keep")
    span = BlobSpan(3, "0" * 64, 7, b"", 8, 100, spool=str(elsewhere / "file"))
    release(span, str(spool))
    assert (elsewhere / "file").read_bytes() == b"keep"
    assert not spool.exists()  # its last chunk gone, the version's directory goes too
