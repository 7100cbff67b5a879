"""The pack of a directory's other files: its header round-trips, and a file list that
would write outside the output, or over itself, is refused when made and when read."""

from __future__ import annotations

import json
import struct

import pytest

from coordinator.plan.file_names import check_relative_path
from coordinator.plan.file_pack import PackedFile, pack_header, packed_files
from coordinator.plan.safetensors_header import LENGTH_PREFIX_BYTES, parse_header
from smoltorrent.errors import UnsafeNameError


def parsed(header: bytes, data_size: int):
    prefix, raw = header[:LENGTH_PREFIX_BYTES], header[LENGTH_PREFIX_BYTES:]
    return parse_header(prefix, raw, len(header) + data_size)


def test_a_pack_header_lists_each_file_at_its_offset_with_its_mode():
    files = [
        PackedFile("b/x.pt", 5, 0o600),
        PackedFile("a.json", 0, 0o644),
        PackedFile("c", 3, 0o755),
    ]
    header, placed = pack_header(files, "d")
    assert [(f.path, f.offset) for f in placed] == [("a.json", 0), ("b/x.pt", 0), ("c", 5)]
    back = packed_files(parsed(header, 8), "d")
    assert sorted(back, key=lambda f: f.path) == placed
    assert pack_header(reversed(files), "d")[0] == header  # canonical: same files, same bytes


@pytest.mark.parametrize(
    "path",
    ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a/./b", "a/", "a\\b", "a\nb", 3, None],
)
def test_a_path_that_is_not_relative_file_names_is_refused(path):
    with pytest.raises(UnsafeNameError):
        check_relative_path(path, "d")


@pytest.mark.parametrize("names", [["a", "a/b"], ["x/y", "x/y/z"]])
def test_a_file_that_is_also_a_folder_is_refused(names):
    with pytest.raises(UnsafeNameError, match="both a file and a folder"):
        pack_header([PackedFile(n, 1, 0o644) for n in names], "d")


def planted(tensors: dict, modes) -> bytes:
    header = dict(tensors)
    header["__metadata__"] = {"smoltorrent.files": json.dumps(modes)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    "tensors,modes",
    [
        ({"../x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, {"../x": 420}),
        ({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, {"y": 420}),
        ({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, {"x": 0o4755}),
        ({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, {"x": "rwx"}),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, {"x": 420}),
        ({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, ["x"]),
    ],
)
def test_a_planted_pack_header_is_refused(tensors, modes):
    header = planted(tensors, modes)
    size = max(t["data_offsets"][1] for t in tensors.values())
    with pytest.raises(UnsafeNameError):
        packed_files(parsed(header, size), "d")
