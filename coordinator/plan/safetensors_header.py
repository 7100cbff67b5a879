"""The .safetensors header: read it, validate it, never touch the data.

A safetensors file is an 8-byte little-endian length N, N bytes of JSON
naming every tensor's dtype, shape and byte range, then the data section.
Everything the store path needs (planning, blob headers, the manifest) comes
from that header, so tensor bytes never become Python objects here.

Validation mirrors what the safetensors library itself accepts, so a file
rejected here would also fail to load, and a file accepted here rebuilds into
something `safetensors.safe_open` loads.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from smoltorrent import defaults
from smoltorrent.errors import CheckpointFormatError, IncompleteCheckpointError

LENGTH_PREFIX_BYTES = 8  # the u64 header length every safetensors file starts with
METADATA_KEY = "__metadata__"

# Bits per element of every dtype safetensors 0.8 accepts; sub-byte types
# (F4, F6_*) only make sense when a tensor's total bits fill whole bytes.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

# Magic numbers of the formats people most often mistake for safetensors.
_LOOKALIKES = (
    (b"PK\x03\x04", "a zip archive, as torch.save writes"),
    (b"\x80", "a Python pickle, as older torch.save writes"),
    (b"\x93NUMPY", "a NumPy .npy file"),
    (b"GGUF", "a GGUF file"),
)
_SAVE_HINT = "save checkpoints with safetensors (e.g. safetensors.torch.save_file)"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offset relative to the data section
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class CheckpointHeader:
    header_bytes: bytes  # the N header bytes exactly as in the file
    tensors: tuple[TensorInfo, ...]  # sorted by (start, end, name)
    metadata: dict[str, str] | None
    file_size: int

    @property
    def data_start(self) -> int:
        return LENGTH_PREFIX_BYTES + len(self.header_bytes)

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start


def format_bytes(count: int) -> str:
    """Decimal units, one decimal: 1234567 -> '1.2 MB', as people read disk sizes."""
    units = ("B", "kB", "MB", "GB", "TB", "PB", "EB")
    value, unit = float(count), 0
    while value >= 999.95 and unit < len(units) - 1:
        value, unit = value / 1000, unit + 1
    return f"{count} B" if unit == 0 else f"{value:.1f} {units[unit]}"


def read_header(path: str | os.PathLike[str]) -> CheckpointHeader:
    """Read and validate only the header of the file at `path`."""
    source = os.fspath(path)
    with open(source, "rb") as file:
        file_size = os.fstat(file.fileno()).st_size
        prefix = file.read(LENGTH_PREFIX_BYTES)
        # Checked before reading N bytes, so a garbage length never becomes a huge read.
        header_length = _check_prefix(prefix, file_size, source)
        header_bytes = file.read(header_length)
    return parse_header(prefix, header_bytes, file_size, source=source)


def parse_header(
    prefix: bytes, header_bytes: bytes, file_size: int, *, source: str = "checkpoint"
) -> CheckpointHeader:
    """Validate a header already read: the 8-byte prefix, the N JSON bytes, the file size."""
    header_length, entries, metadata = _entries(
        prefix, header_bytes, file_size, source, _checked_entry
    )
    # Each tensor's JSON object is dropped once its TensorInfo is built (in the header's
    # order, so the first bad tensor is still the one named): thousands of tensors are
    # never held twice, as JSON and as TensorInfo.
    tensors = sorted(
        (_check_tensor(name, entries.pop(name), source) for name in list(entries)),
        key=lambda tensor: (tensor.start, tensor.end, tensor.name),
    )
    data_size = file_size - LENGTH_PREFIX_BYTES - header_length
    _check_layout(((t.start, t.end, t.name) for t in tensors), data_size, source)
    return CheckpointHeader(header_bytes, tuple(tensors), metadata, file_size)


def checked_data_size(
    prefix: bytes, header_bytes: bytes, file_size: int, *, source: str = "checkpoint"
) -> int:
    """The size of the data section a header describes, after every check parse_header
    makes (raising the same errors), keeping of each tensor only its byte range and name:
    a manifest's parse checks its chunks against its header, and the dtypes, shapes and
    TensorInfos it has no use for were a third of that check's memory for thousands of
    tensors."""
    header_length, entries, _ = _entries(prefix, header_bytes, file_size, source, _checked_range)
    ranges = sorted(_range(name, entries.pop(name), source) for name in list(entries))
    data_size = file_size - LENGTH_PREFIX_BYTES - header_length
    _check_layout(ranges, data_size, source)
    return data_size


def _entries(
    prefix: bytes, header_bytes: bytes, file_size: int, source: str, hook: Callable
) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """The header's length, its tensors' entries by name (each as `hook` made it) and its
    metadata, the prefix, the length and the metadata checked."""
    header_length = _check_prefix(prefix, file_size, source)
    if len(header_bytes) != header_length:
        _fail(
            source,
            f"truncated header: expected {header_length} header bytes, got {len(header_bytes)}",
            "the file was cut short; copy it again or wait until it is fully written",
            incomplete=True,
        )
    entries = _decode_json(header_bytes, source, hook)
    return header_length, entries, _check_metadata(entries.pop(METADATA_KEY, None), source)


def _range(name: str, entry: Any, source: str) -> tuple[int, int, str]:
    """(start, end, name) of a tensor, checked as _check_tensor does."""
    if type(entry) is tuple:  # checked as it was decoded (_checked_range)
        return entry[0], entry[1], name
    tensor = _check_tensor(name, entry, source)
    return tensor.start, tensor.end, tensor.name


def _fail(source: str, problem: str, advice: str, *, incomplete: bool = False) -> NoReturn:
    """Raise the error; `incomplete`: the file is shorter than its header says (more bytes
    may still come)."""
    error = IncompleteCheckpointError if incomplete else CheckpointFormatError
    raise error(f"{problem} ({source}); {advice}.")


def _lookalike(prefix: bytes) -> str:
    for magic, description in _LOOKALIKES:
        if prefix.startswith(magic):
            return f" (it looks like {description})"
    return ""


def _check_prefix(prefix: bytes, file_size: int, source: str) -> int:
    """Return the header length N after checking it fits the file and the spec's limit."""
    if file_size < LENGTH_PREFIX_BYTES:
        what = "empty file" if file_size == 0 else f"only {file_size} bytes long"
        _fail(
            source,
            f"not a safetensors file: {what}, shorter than the 8-byte header length",
            "wait until the training job has finished writing it, or " + _SAVE_HINT,
            incomplete=True,
        )
    if len(prefix) != LENGTH_PREFIX_BYTES:
        _fail(
            source,
            f"truncated file: got {len(prefix)} of the 8 header length bytes",
            "the file shrank while it was read; wait until it is fully written",
            incomplete=True,
        )
    (header_length,) = struct.unpack("<Q", prefix)
    if LENGTH_PREFIX_BYTES + header_length > file_size:
        _fail(
            source,
            f"not a safetensors file{_lookalike(prefix)}: header length "
            f"{format_bytes(header_length)} exceeds file size {format_bytes(file_size)}",
            _SAVE_HINT + ", or copy the file again if it was cut short",
            # A length the format allows: the rest of the header may still be coming.
            incomplete=header_length <= defaults.MAX_SAFETENSORS_HEADER_BYTES,
        )
    if header_length > defaults.MAX_SAFETENSORS_HEADER_BYTES:
        _fail(
            source,
            f"not a safetensors file: header length {format_bytes(header_length)} exceeds "
            f"the {format_bytes(defaults.MAX_SAFETENSORS_HEADER_BYTES)} limit of the format",
            _SAVE_HINT,
        )
    return header_length


class _DuplicateKey(Exception):
    """Internal: the JSON repeats a key, which a dict would silently drop."""


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


# dtype -> the one str of it: every tensor checked at parse time names its dtype with it
_DTYPES = {dtype: dtype for dtype in DTYPE_BITS}


def _checked_entry(pairs: list[tuple[str, Any]]) -> dict[str, Any] | tuple:
    """A JSON object of the header as the decoder builds it: a tensor's object that
    _check_tensor accepts becomes (dtype, shape, start, end) at once, a tuple no JSON value
    can be, so thousands of tensors are never held as a dict, two lists and their own dtype
    strings each; anything else stays a dict and is checked (and named) as before."""
    entry = _reject_duplicate_keys(pairs)
    fields = _tensor_fields(entry)
    if fields is None:
        return entry
    dtype, shape, start, end = fields
    return (_DTYPES[dtype], tuple(shape), start, end)


def _checked_range(pairs: list[tuple[str, Any]]) -> dict[str, Any] | tuple:
    """_checked_entry for checked_data_size: a tensor's object becomes (start, end)."""
    entry = _reject_duplicate_keys(pairs)
    fields = _tensor_fields(entry)
    return entry if fields is None else (fields[2], fields[3])


def _tensor_fields(entry: dict[str, Any]) -> tuple[str, list, int, int] | None:
    """(dtype, shape, start, end) of a tensor's object _check_tensor accepts, else None."""
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (
        type(dtype) is not str
        or dtype not in DTYPE_BITS
        or type(shape) is not list
        or not all(_is_count(dim) for dim in shape)
        or type(offsets) is not list
        or len(offsets) != 2
        or not all(_is_count(offset) for offset in offsets)
        or offsets[0] > offsets[1]
    ):
        return None
    if _bytes_of(shape, dtype) != offsets[1] - offsets[0]:
        return None
    return dtype, shape, offsets[0], offsets[1]


def _decode_json(header_bytes: bytes, source: str, hook: Callable) -> dict[str, Any]:
    bad_header = "not a safetensors file: the header is not"
    try:
        text = header_bytes.decode("utf-8")
    except UnicodeDecodeError as error:
        _fail(source, f"{bad_header} UTF-8 ({error.reason} at byte {error.start})", _SAVE_HINT)
    try:
        entries = json.loads(text, object_pairs_hook=hook)
        if type(entries) is tuple:  # the whole header is one tensor's object: not a header
            entries = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except _DuplicateKey as duplicate:
        _fail(
            source,
            f"invalid safetensors header: the key {duplicate.args[0]!r} appears twice",
            "re-save the checkpoint; each tensor name must be unique",
        )
    except json.JSONDecodeError as error:
        _fail(source, f"{bad_header} valid JSON ({error.msg} at byte {error.pos})", _SAVE_HINT)
    if not isinstance(entries, dict):
        _fail(source, f"{bad_header} a JSON object", _SAVE_HINT)
    return entries


def _check_metadata(metadata: Any, source: str) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(
        isinstance(value, str) for value in metadata.values()
    ):
        _fail(
            source,
            f"invalid safetensors header: {METADATA_KEY} must map strings to strings",
            "store metadata values as strings (e.g. json.dumps them) and save again",
        )
    return metadata


def _is_count(value: Any) -> bool:
    # bool is an int subclass, but `true` is not a size.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tensor(name: str, entry: Any, source: str) -> TensorInfo:
    if type(entry) is tuple:  # checked as it was decoded (_checked_entry)
        return TensorInfo(name, *entry)
    resave = "re-save the checkpoint with a safetensors writer"

    def fail(problem: str) -> NoReturn:
        _fail(source, f"invalid safetensors header: tensor {name!r} {problem}", resave)

    if not isinstance(entry, dict):
        fail("is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        fail(f"has unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_count(dim) for dim in shape):
        fail(f"has shape {shape!r}; dimensions must be non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(offset) for offset in offsets)
        or offsets[0] > offsets[1]
    ):
        fail(f"has data_offsets {offsets!r}; they must be [start, end] with 0 <= start <= end")
    start, end = offsets
    needed = _bytes_of(shape, dtype)
    if needed != end - start:
        shown = repr(shape) if len(shape) <= 16 else f"of {len(shape)} dimensions"
        fail(
            f"of dtype {dtype} and shape {shown} needs "
            + (f"{needed:g}" if needed is not None else f"over {_MOST_BYTES}")
            + f" bytes, but its data_offsets span {end - start}"
        )
    return TensorInfo(name, dtype, tuple(shape), start, end)


_MOST_BYTES = 2**64  # no file holds a tensor past this: its size needs no exact figure


def _bytes_of(shape: list[int], dtype: str) -> float | None:
    """The bytes a tensor of `shape` and `dtype` takes (a fraction where its bits do not
    fill whole bytes), or None past _MOST_BYTES: the product stops there, so a hostile
    shape of many dimensions costs one pass, not a number of as many bits (quadratic)."""
    if 0 in shape:
        return 0
    bits = DTYPE_BITS[dtype]
    for dim in shape:
        bits *= dim
        if bits > 8 * _MOST_BYTES:
            return None
    return bits / 8


def _check_layout(ranges: Iterable[tuple[int, int, str]], data_size: int, source: str) -> None:
    """Tensors, as (start, end, name) in that order, must tile the data section exactly: no
    overlap, no hole, nothing after."""
    resave = "re-save the checkpoint with a safetensors writer"
    covered = 0
    previous = None
    for start, end, name in ranges:
        if start < covered:
            _fail(
                source,
                f"invalid safetensors header: tensor {name!r} at bytes "
                f"{start}-{end} overlaps {previous!r}, which ends at {covered}",
                resave,
            )
        if start > covered:
            _fail(
                source,
                f"invalid safetensors header: {start - covered} bytes at offset {covered} "
                f"of the data section belong to no tensor (a hole before {name!r})",
                resave,
            )
        covered, previous = end, name
    if data_size < covered:
        _fail(
            source,
            f"truncated file: the data section holds {format_bytes(data_size)} but the tensors "
            f"need {format_bytes(covered)} ({covered - data_size} bytes missing)",
            "the file was cut short; wait until it is fully written or copy it again",
            incomplete=True,
        )
    if data_size > covered:
        _fail(
            source,
            f"invalid safetensors file: {data_size - covered} trailing bytes after the last "
            "tensor belong to no tensor",
            "the file may have been appended to or overwritten in place; re-save it",
        )
