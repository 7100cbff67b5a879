"""Planning a directory checkpoint: its files and index, refused when they disagree."""

from __future__ import annotations

import dataclasses
import json

import pytest
from safetensors.torch import load as safetensors_load

from coordinator.plan.directory import (
    DIRECTORY_KEY,
    FILES_KEY,
    INDEX_KEY,
    INDEX_NAME_KEY,
    DirectoryRecord,
    path_in,
    plan_directory,
    record_bytes,
    record_of,
)
from coordinator.plan.safetensors_header import read_header
from smoltorrent.errors import CheckpointFormatError, UnsafeNameError, UsageError
from tests.checkpoints import write_hf_dir

INDEX = "model.safetensors.index.json"


def edit_index(root, edit) -> None:
    index = json.loads((root / INDEX).read_text())
    edit(index)
    (root / INDEX).write_text(json.dumps(index))


def test_files_index_and_the_rest(tmp_path):
    write_hf_dir(tmp_path / "m", parts=2)
    plan = plan_directory(tmp_path / "m")
    assert plan.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    assert plan.index_name == INDEX and plan.ignored == ("config.json",)
    assert plan.index_bytes == (tmp_path / "m" / INDEX).read_bytes()


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda i: i["weight_map"].update(extra="model-00009-of-00009.safetensors"), "does not"),
        (lambda i: i["weight_map"].pop(sorted(i["weight_map"])[0]), "disagree on its tensors"),
        (lambda i: i.pop("weight_map"), "no weight_map"),
    ],
    ids=["unknown-file", "unmapped-tensor", "no-weight-map"],
)
def test_an_index_that_contradicts_the_files_is_refused(tmp_path, edit, words):
    write_hf_dir(tmp_path / "m", parts=2)
    edit_index(tmp_path / "m", edit)
    with pytest.raises(CheckpointFormatError, match=words):
        plan_directory(tmp_path / "m")


def test_a_directory_without_safetensors_files_is_a_usage_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UsageError, match="is a directory with no .safetensors files"):
        plan_directory(tmp_path)


def test_the_record_is_a_tensorless_safetensors_file_that_says_it_all(tmp_path):
    record = DirectoryRecord("hf/m", {"b.safetensors": "2" * 64, "a.safetensors": "1" * 64},
                             INDEX, b'{"weight_map": {"x": "a.safetensors"}}')  # fmt: skip
    raw = record_bytes(record)
    assert raw == record_bytes(
        dataclasses.replace(record, files=dict(sorted(record.files.items())))
    )
    path = tmp_path / "r.safetensors"
    path.write_bytes(raw)
    header = read_header(path)  # a valid safetensors file: no tensors, no data
    assert header.tensors == () and header.file_size == len(raw)
    assert record_of(header) == record
    assert safetensors_load(raw) == {}
    bare = DirectoryRecord("hf/m", {"a.safetensors": "1" * 64}, None, None)
    path.write_bytes(record_bytes(bare))
    assert record_of(read_header(path)) == bare


def test_other_headers_are_no_record(tmp_path):
    write_hf_dir(tmp_path / "m", parts=1)
    assert record_of(read_header(tmp_path / "m" / "model-00001-of-00001.safetensors")) is None


UNSAFE = ["/home/u/.bashrc", "../../x", "..", ".", "", "a/b.safetensors", "a\\b", "a\nb"]


@pytest.mark.parametrize("bad", UNSAFE)
def test_a_file_or_index_name_is_one_file_name_when_made_and_when_parsed(tmp_path, bad):
    with pytest.raises(UnsafeNameError, match="is not one file name"):
        DirectoryRecord("hf/m", {bad: "1" * 64}, None, None)
    with pytest.raises(UnsafeNameError, match="is not one file name"):
        DirectoryRecord("hf/m", {"a.safetensors": "1" * 64}, bad, b"{}")
    with pytest.raises(UnsafeNameError):
        path_in(str(tmp_path), bad, "hf/m")
    # A node's copy of a record holding it: its parse refuses it too.
    metadata = {
        DIRECTORY_KEY: "hf/m",
        FILES_KEY: json.dumps({"a.safetensors": "1" * 64}),
        INDEX_NAME_KEY: bad,
        INDEX_KEY: "{}",
    }
    raw = json.dumps({"__metadata__": metadata}).encode()
    path = tmp_path / "r.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(UnsafeNameError):
        record_of(read_header(path))
