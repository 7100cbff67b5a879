"""Header parsing: every valid layout parses, every broken one fails with a sentence.

Each rejection is also checked against the safetensors library itself, so
the validator neither refuses what it loads nor accepts what it refuses.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open

from coordinator.plan.safetensors_header import (
    DTYPE_BITS,
    CheckpointHeader,
    TensorInfo,
    checked_data_size,
    format_bytes,
    parse_header,
    read_header,
)
from smoltorrent.errors import CheckpointFormatError
from tests.checkpoints import (
    LLM_METADATA,
    raw_file_bytes,
    write_llm_like,
    write_mlx,
    write_one_giant,
    write_raw,
)


def u8(start: int, end: int, dtype: str = "U8") -> dict:
    return {"dtype": dtype, "shape": [end - start], "data_offsets": [start, end]}


def library_loads(path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as checkpoint:
            list(checkpoint.keys())
    except Exception:
        return False
    return True


def assert_matches_library(header: CheckpointHeader, path) -> None:
    with safe_open(str(path), framework="pt") as checkpoint:
        assert sorted(t.name for t in header.tensors) == sorted(checkpoint.keys())
        assert header.metadata == checkpoint.metadata()
        for tensor in header.tensors:
            view = checkpoint.get_slice(tensor.name)
            assert view.get_dtype() == tensor.dtype
            assert tuple(view.get_shape()) == tensor.shape


def test_llm_like_checkpoint_parses_like_the_library_reads_it(tmp_path):
    path = tmp_path / "step_100.safetensors"
    write_llm_like(path)
    header = read_header(path)
    assert_matches_library(header, path)
    assert header.metadata == LLM_METADATA
    assert header.file_size == path.stat().st_size
    assert header.data_start == 8 + len(header.header_bytes)
    assert path.read_bytes()[8 : header.data_start] == header.header_bytes
    assert header.data_size == header.tensors[-1].end
    assert [t.start for t in header.tensors] == sorted(t.start for t in header.tensors)
    dtypes = {t.dtype for t in header.tensors}
    assert {"BF16", "F16", "F32", "I8", "I64", "BOOL", "F8_E4M3", "F8_E5M2"} <= dtypes
    assert any(t.shape == () for t in header.tensors)
    assert any(0 in t.shape and t.start == t.end for t in header.tensors)


def test_mlx_file_without_alignment_padding_parses(tmp_path):
    path = tmp_path / "mlx.safetensors"
    write_mlx(path)
    header = read_header(path)
    assert_matches_library(header, path)
    assert header.metadata == {"framework": "mlx"}
    assert any(t.start % 8 for t in header.tensors)  # packed: some tensor starts unaligned


def test_one_giant_tensor_parses(tmp_path):
    path = tmp_path / "giant.safetensors"
    write_one_giant(path)
    assert_matches_library(read_header(path), path)


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_every_dtype_the_library_knows_parses(tmp_path, dtype):
    size = DTYPE_BITS[dtype]  # 8 elements of `bits` bits take `bits` bytes
    path = tmp_path / "dtype.safetensors"
    entry = {"dtype": dtype, "shape": [2, 4], "data_offsets": [0, size]}
    write_raw(path, {"x": entry}, bytes(size))
    assert library_loads(path)
    assert read_header(path).tensors[0].dtype == dtype


@pytest.mark.parametrize(
    ("header", "data"),
    [
        pytest.param({}, b"", id="no-tensors"),
        pytest.param({"__metadata__": {"step": "7"}}, b"", id="metadata-only"),
        pytest.param({"__metadata__": None, "x": u8(0, 2)}, b"ab", id="null-metadata"),
        pytest.param(
            {"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, b"abcd", id="scalar"
        ),
        pytest.param(
            {
                "a": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
                "b": {"dtype": "BF16", "shape": [0], "data_offsets": [0, 0]},
                "c": u8(0, 2),
                "d": {"dtype": "I64", "shape": [4, 0], "data_offsets": [2, 2]},
            },
            b"ab",
            id="zero-size",
        ),
        pytest.param({"x": {**u8(0, 2), "extra": 1}}, b"ab", id="unknown-entry-field"),
        pytest.param({"q": {"dtype": "F4", "shape": [6], "data_offsets": [0, 3]}}, b"abc", id="F4"),
    ],
)
def test_valid_layouts_parse(tmp_path, header, data):
    path = tmp_path / "ok.safetensors"
    write_raw(path, header, data)
    assert library_loads(path)
    parsed = read_header(path)
    assert parsed.data_size == len(data)
    assert len(parsed.tensors) == len([k for k in header if k != "__metadata__"])


def test_header_padded_with_spaces_parses(tmp_path):
    path = tmp_path / "padded.safetensors"
    write_raw(path, {"x": u8(0, 3)}, b"abc", pad_to=64)
    header = read_header(path)
    assert header.header_bytes.endswith(b" ") and len(header.header_bytes) % 64 == 0
    assert header.tensors[0].name == "x"


def test_zero_size_tensors_sort_deterministically_by_offset_then_name(tmp_path):
    path = tmp_path / "zeros.safetensors"
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [2, 2]}
    write_raw(path, {"z": empty, "y": empty, "w": u8(2, 3), "v": u8(0, 2)}, b"abc")
    assert [t.name for t in read_header(path).tensors] == ["v", "y", "z", "w"]


def test_read_header_never_reads_the_data_section(tmp_path):
    # A sparse 8 GB file: reading its data would take seconds and gigabytes.
    path = tmp_path / "sparse.safetensors"
    size = 8 * 1024**3
    write_raw(path, {"huge": u8(0, size)})
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size + size)
    before = _bytes_read_by_this_process()
    header = read_header(path)
    read = _bytes_read_by_this_process() - before
    assert header.data_size == size and header.tensors[0].end == size
    header_end = 8 + len(header.header_bytes)
    # Buffered reads may run a little past the header, never into gigabytes of data.
    assert read <= header_end + HEADER_READ_SLACK_BYTES, read


HEADER_READ_SLACK_BYTES = 256 * 1024  # bytes; buffer read-ahead and /proc/self/io itself


def _bytes_read_by_this_process() -> int:
    """rchar of /proc/self/io: every byte this process got from read() calls."""
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


BAD_FILES = [
    # (id, file bytes, words the message must contain)
    ("empty", b"", "empty file"),
    ("five-bytes", b"\x01\x02\x03\x04\x05", "only 5 bytes long"),
    ("random-bytes", bytes(range(7, 250)) * 3, "exceeds file size"),
    (
        "length-too-big",
        struct.pack("<Q", 2**63) + b"{}",
        "header length 9.2 EB exceeds file size 10 B",
    ),
    ("not-utf8", raw_file_bytes(b'{"\xff": 1}'), "not UTF-8"),
    ("not-json", raw_file_bytes(b"{nope}"), "not valid JSON"),
    ("json-array", raw_file_bytes(b"[]"), "not a JSON object"),
    ("truncated-header", raw_file_bytes(b'{"x": 1}')[:-2], "exceeds file size"),
    ("entry-not-object", raw_file_bytes({"x": [1]}), "'x' is not a JSON object"),
    ("unknown-dtype", raw_file_bytes({"x": u8(0, 2, "C128")}, b"ab"), "unknown dtype 'C128'"),
    ("lowercase-dtype", raw_file_bytes({"x": u8(0, 2, "u8")}, b"ab"), "unknown dtype 'u8'"),
    ("missing-dtype", raw_file_bytes({"x": {"shape": [1], "data_offsets": [0, 1]}}, b"a"), "dtype"),
    (
        "size-mismatch",
        raw_file_bytes({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"abcd"),
        "needs 8 bytes, but its data_offsets span 4",
    ),
    (
        "negative-dim",
        raw_file_bytes({"x": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}}, b"ab"),
        "non-negative integers",
    ),
    (
        "float-dim",
        raw_file_bytes({"x": {"dtype": "U8", "shape": [2.0], "data_offsets": [0, 2]}}, b"ab"),
        "non-negative integers",
    ),
    (
        "bool-dim",
        raw_file_bytes({"x": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"a"),
        "non-negative integers",
    ),
    (
        "shape-not-list",
        raw_file_bytes({"x": {"dtype": "U8", "shape": 2, "data_offsets": [0, 2]}}, b"ab"),
        "non-negative integers",
    ),
    (
        "three-offsets",
        raw_file_bytes({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2, 2]}}, b"ab"),
        "[start, end]",
    ),
    (
        "reversed-offsets",
        raw_file_bytes({"x": {"dtype": "U8", "shape": [0], "data_offsets": [2, 0]}}, b"ab"),
        "[start, end]",
    ),
    (
        "sub-byte-remainder",
        raw_file_bytes({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"ab"),
        "needs 1.5 bytes",
    ),
    ("overlap", raw_file_bytes({"a": u8(0, 4), "b": u8(2, 6)}, b"abcdef"), "overlaps 'a'"),
    ("hole", raw_file_bytes({"a": u8(0, 2), "b": u8(3, 5)}, b"abcde"), "belong to no tensor"),
    ("starts-late", raw_file_bytes({"a": u8(1, 3)}, b"abc"), "1 bytes at offset 0"),
    ("truncated-data", raw_file_bytes({"a": u8(0, 4), "b": u8(4, 9)}, b"abcdef"), "truncated file"),
    ("trailing-bytes", raw_file_bytes({"a": u8(0, 2)}, b"abcd"), "2 trailing bytes"),
    (
        "duplicate-name",
        raw_file_bytes(
            b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
            b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
            b"ab",
        ),
        "'a' appears twice",
    ),
    (
        "metadata-int",
        raw_file_bytes({"__metadata__": {"step": 7}}),
        "__metadata__ must map strings to strings",
    ),
    ("metadata-list", raw_file_bytes({"__metadata__": ["a"]}), "__metadata__ must map strings"),
]


@pytest.mark.parametrize(
    ("content", "words"), [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES]
)
def test_broken_file_is_rejected_with_a_sentence(tmp_path, content, words):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointFormatError) as raised:
        read_header(path)
    message = str(raised.value)
    assert words in message
    assert f"({path})" in message  # names the file
    assert message.endswith(".")  # and says what to do, as a sentence
    assert not library_loads(path)


def test_torch_zip_file_is_recognised(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(4)}, path)
    with pytest.raises(CheckpointFormatError, match="zip archive, as torch.save writes"):
        read_header(path)


def test_legacy_torch_pickle_is_recognised(tmp_path):
    path = tmp_path / "model.bin"
    torch.save({"w": torch.ones(4)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointFormatError, match="Python pickle"):
        read_header(path)


def test_checkpoint_cut_short_is_reported_as_truncated(tmp_path):
    whole = tmp_path / "whole.safetensors"
    write_llm_like(whole)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole.read_bytes()[:-1000])
    with pytest.raises(CheckpointFormatError, match="truncated file.*1000 bytes missing"):
        read_header(cut)


def test_header_over_the_format_limit_is_rejected_before_reading_it():
    prefix = struct.pack("<Q", 200_000_000)
    with pytest.raises(CheckpointFormatError, match=r"200\.0 MB exceeds the 100\.0 MB limit"):
        parse_header(prefix, b"", 10**12, source="big.safetensors")


def test_parse_header_is_pure_and_names_its_source():
    header_bytes = b'{"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}'
    prefix = struct.pack("<Q", len(header_bytes))
    parsed = parse_header(prefix, header_bytes, 8 + len(header_bytes) + 3)
    assert parsed.tensors[0].end == 3
    with pytest.raises(CheckpointFormatError, match=r"\(grpo/latest.safetensors\)"):
        parse_header(
            prefix, header_bytes, 8 + len(header_bytes) + 2, source="grpo/latest.safetensors"
        )
    with pytest.raises(CheckpointFormatError, match="truncated header"):
        parse_header(prefix, header_bytes[:-1], 8 + len(header_bytes) + 3)
    with pytest.raises(CheckpointFormatError, match="got 5 of the 8 header length bytes"):
        parse_header(prefix[:5], header_bytes, 8 + len(header_bytes) + 3)  # file shrank mid-read


@pytest.mark.parametrize(
    ("count", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (1_234_567_890, "1.2 GB"), (2**63, "9.2 EB")],
)
def test_format_bytes(count, text):
    assert format_bytes(count) == text


def _parsed(entries: dict, data_size: int):
    raw = json.dumps(entries).encode()
    return parse_header(struct.pack("<Q", len(raw)), raw, 8 + len(raw) + data_size)


def test_tensors_checked_as_they_are_decoded_parse_as_before():
    """Each tensor's JSON object becomes a compact tuple as soon as the decoder builds it
    (thousands of tensors are never held as dicts and lists): the header parses to the
    same TensorInfos, extra keys ignored, every dtype's one string shared."""
    header = _parsed(
        {
            "__metadata__": {"format": "pt"},
            "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [2, 14], "extra": [1]},
            "a": {"data_offsets": [0, 2], "shape": [], "dtype": "F16"},
            "c": {"dtype": "BF16", "shape": [0], "data_offsets": [14, 14]},
        },
        14,
    )
    assert header.metadata == {"format": "pt"}
    assert header.tensors == (
        TensorInfo("a", "F16", (), 0, 2),
        TensorInfo("b", "BF16", (2, 3), 2, 14),
        TensorInfo("c", "BF16", (0,), 14, 14),
    )
    assert header.tensors[1].dtype is header.tensors[2].dtype


@pytest.mark.parametrize(
    ("entries", "data_size", "words"),
    [
        # A header that is itself one tensor's object names its keys as tensors, as before.
        ({"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, 2, "tensor 'dtype' is not a"),
        (
            {"__metadata__": u8(0, 2), "a": u8(0, 2)},
            2,
            "__metadata__ must map strings to strings",
        ),
        ({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, 1, "shape \\[True\\]"),
        ({"a": u8(0, 2), "b": {**u8(2, 4), "dtype": "X"}}, 4, "tensor 'b' has unknown dtype"),
        ({"a": {**u8(0, 2), "shape": [3]}}, 2, "tensor 'a' of dtype U8 and shape \\[3\\] needs"),
    ],
)
def test_a_tensor_not_checked_at_decode_time_is_named_as_before(entries, data_size, words):
    with pytest.raises(CheckpointFormatError, match=words):
        _parsed(entries, data_size)


@pytest.mark.parametrize(
    ("content", "words"), [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES]
)
def test_a_manifests_header_check_refuses_what_a_parse_refuses(content, words):
    """checked_data_size (a manifest's check of its chunks) keeps only each tensor's range
    and name, and refuses every broken header with parse_header's own error."""
    prefix = content[:8]
    header_bytes = content[8 : 8 + struct.unpack("<Q", prefix)[0]] if len(prefix) == 8 else b""
    with pytest.raises(CheckpointFormatError) as parsed:
        parse_header(prefix, header_bytes, len(content))
    with pytest.raises(CheckpointFormatError) as checked:
        checked_data_size(prefix, header_bytes, len(content))
    assert (type(checked.value), str(checked.value)) == (type(parsed.value), str(parsed.value))


def test_a_manifests_header_check_gives_the_data_size():
    raw = json.dumps({"__metadata__": {"a": "b"}, "x": u8(0, 2), "y": u8(2, 5)}).encode()
    prefix = struct.pack("<Q", len(raw))
    assert checked_data_size(prefix, raw, 8 + len(raw) + 5) == 5
    assert parse_header(prefix, raw, 8 + len(raw) + 5).data_size == 5


@pytest.mark.parametrize("check", [parse_header, checked_data_size])
def test_a_shape_of_80k_dimensions_is_refused_as_a_format_error(check):
    """issue 38 2e: a header (a node's manifest copy carries one) whose tensor has 80,000
    dimensions of 2 made math.prod build a 80,000-bit number, quadratic, and then the
    message's bytes-needed figure overflowed a float (OverflowError, not a format error,
    which aborted a whole rebuild). The product stops once past what the offsets span,
    and the refusal is a short sentence."""
    shape = [2] * 80_000
    raw = json.dumps({"x": {"dtype": "U8", "shape": shape, "data_offsets": [0, 4]}}).encode()
    prefix = struct.pack("<Q", len(raw))
    with pytest.raises(CheckpointFormatError, match="data_offsets span 4") as refused:
        check(prefix, raw, 8 + len(raw) + 4)
    assert len(str(refused.value)) < 500
