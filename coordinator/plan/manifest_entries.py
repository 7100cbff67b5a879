"""A manifest's entries: a shard (schemas 1 and 2) or a chunk (schema 3) each, and the
ChunkTable that holds a chunked manifest's chunks in a few flat buffers; the entries a
store makes from its plans and their digests.
"""

from __future__ import annotations

import binascii
import io
import re
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from coordinator.plan.chunks import ChunkPlan
from coordinator.plan.manifest_checks import SHA256_HEX
from coordinator.plan.planner import ShardPlan


@dataclass(frozen=True)
class ShardEntry:
    index: int
    data_start: int  # relative to the source's data section
    data_end: int
    tensors: tuple[str, ...]  # in data order
    blob_size: int
    blob_sha256: str
    blob_data_offset: int  # == len(blob prefix): where the source bytes start in the blob
    # SHA-256 of each tensor's bytes, in the order of `tensors`; None in schema 1 manifests
    tensor_sha256: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    index: int  # its position in the manifest's chunks (not written: the order says it)
    data_start: int  # relative to the source's data section
    data_end: int
    raw_sha256: str  # of the raw bytes: the chunk's address, the same in every version
    blob_size: int  # of the encoded chunk a node keeps and verifies
    blob_sha256: str


DIGEST_BYTES = 32  # a SHA-256


class ChunkColumns:
    """A ChunkTable's five buffers as they are filled, a chunk at a time."""

    def __init__(self) -> None:
        self.starts, self.ends, self.sizes = array("q"), array("q"), array("q")
        self.raw, self.blob = bytearray(), bytearray()

    def add(self, start: int, end: int, size: int, raw: bytes, blob: bytes) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.sizes.append(size)
        self.raw += raw
        self.blob += blob

    def add_match(self, found: re.Match) -> str | bytes:
        """One chunk's object matched by CHUNK_TEXT or _CHUNK_BYTES; what follows it."""
        blob_hex, size, end, start, raw_hex, after = found.groups()
        self.add(
            int(start),
            int(end),
            int(size),
            binascii.unhexlify(raw_hex),
            binascii.unhexlify(blob_hex),
        )
        return after

    def table(self) -> ChunkTable:
        return ChunkTable(self.starts, self.ends, self.sizes, bytes(self.raw), bytes(self.blob))


class ChunkTable(Sequence[ChunkEntry]):
    """A manifest's chunks, held in five flat buffers (each chunk's data_start, data_end
    and blob size as 64-bit integers, its two SHA-256 as 32 bytes each): ~90 bytes a chunk
    in a handful of allocations, where a tuple of ChunkEntry held ~430 in six small objects
    a chunk. A 16 GB checkpoint's 4,629 chunks are 0.4 MB here against 2 MB, and buffers
    that size come from malloc's own mappings, given back whole when the manifest goes,
    not pymalloc's arenas, which a few survivors among thousands of small objects pin for
    the rest of a worker child's life (bench/RESULTS.md, memflat5).

    Reads as the tuple it replaces: indexing, iteration, len and == against any sequence
    of ChunkEntry; an entry is built as it is read."""

    __slots__ = ("_starts", "_ends", "_sizes", "_raw", "_blob")

    def __init__(self, starts: array, ends: array, sizes: array, raw: bytes, blob: bytes):
        self._starts, self._ends, self._sizes = starts, ends, sizes
        self._raw, self._blob = raw, blob

    @classmethod
    def of(cls, entries: Iterable[ChunkEntry]) -> ChunkTable:
        """The table of `entries`, each at the position its index says (ValueError
        otherwise, or for a digest that is not 64 lowercase hex digits)."""
        if isinstance(entries, ChunkTable):
            return entries
        columns = ChunkColumns()
        for position, entry in enumerate(entries):
            if entry.index != position:
                raise ValueError(f"chunk {entry.index} is listed at position {position}")
            columns.add(
                entry.data_start,
                entry.data_end,
                entry.blob_size,
                _digest_bytes(entry.raw_sha256),
                _digest_bytes(entry.blob_sha256),
            )
        return columns.table()

    def __len__(self) -> int:
        return len(self._starts)

    def write_json(self, out: io.BytesIO) -> None:
        """The chunks as Manifest.to_json writes them (canonical: sorted keys, no spaces),
        straight from the buffers, one chunk at a time."""
        out.write(b"[")
        rows = zip(self._starts, self._ends, self._sizes, strict=True)
        for i, (start, end, size) in enumerate(rows):
            at = i * DIGEST_BYTES
            out.write(
                b'%s{"blob_sha256":"%s","blob_size":%d,"data_end":%d,"data_start":%d,'
                b'"raw_sha256":"%s"}'
                % (
                    b"," if i else b"",
                    binascii.hexlify(self._blob[at : at + DIGEST_BYTES]),
                    size,
                    end,
                    start,
                    binascii.hexlify(self._raw[at : at + DIGEST_BYTES]),
                )
            )
        out.write(b"]")

    def json_size(self) -> int:
        """How many bytes write_json writes."""
        fixed = len(b'{"blob_sha256":"","blob_size":,"data_end":,"data_start":,"raw_sha256":""}')
        count = len(self)
        digits = sum(len(str(value)) for part in (self._starts, self._ends, self._sizes)
                     for value in part)  # fmt: skip
        return 2 + max(count - 1, 0) + count * (fixed + 4 * DIGEST_BYTES) + digits

    @classmethod
    def from_canonical_json(cls, data: bytes | str, start: int) -> tuple[ChunkTable, int] | None:
        """The chunk list that opens at `start` of a manifest's JSON text, read straight
        into a table when it is written as to_json writes it (every manifest smoltorrent
        stores), with the offset just past its closing bracket; None when it is not
        (spaces, another key order, a value _parse_chunk would not take, a number past
        18 digits): the caller then decodes the whole text as JSON. No object per chunk is
        kept, nor a JSON document of the whole list built."""
        pattern, close = (_CHUNK_BYTES, b"]") if isinstance(data, bytes) else (CHUNK_TEXT, "]")
        columns = ChunkColumns()
        position = start + 1  # past the "["
        if data[position : position + 1] != close:
            match = pattern.match
            while True:
                found = match(data, position)
                if found is None:
                    return None
                position = found.end()
                if columns.add_match(found) == close:
                    break
            position -= 1
        return columns.table(), position + 1

    def _entry(self, i: int) -> ChunkEntry:
        at = i * DIGEST_BYTES
        return ChunkEntry(
            i,
            self._starts[i],
            self._ends[i],
            self._raw[at : at + DIGEST_BYTES].hex(),
            self._sizes[i],
            self._blob[at : at + DIGEST_BYTES].hex(),
        )

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._entry(j) for j in range(*i.indices(len(self))))
        count = len(self)
        if not -count <= i < count:
            raise IndexError("chunk index out of range")
        return self._entry(i + count if i < 0 else i)

    def __iter__(self) -> Iterator[ChunkEntry]:
        return map(self._entry, range(len(self)))

    def ranges(self) -> Iterator[tuple[int, int]]:
        """(data_start, data_end) of each chunk, in order, no entry built."""
        return zip(self._starts, self._ends, strict=True)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            return self._key() == other._key()
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def _key(self) -> tuple:
        return (self._starts, self._ends, self._sizes, self._raw, self._blob)

    def __hash__(self) -> int:
        return hash(tuple(bytes(part) for part in self._key()))

    def __repr__(self) -> str:
        return f"ChunkTable({list(self)!r})"


# One chunk's object exactly as to_json writes it, with what follows it (a comma or the
# list's end). Its values are those _parse_chunk takes: 64 lowercase hex digits, a
# blob size of at least 1; at most 18 digits, so every number fits the table's int64.
_CHUNK_PATTERN = (
    r'\{"blob_sha256":"([0-9a-f]{64})","blob_size":([1-9][0-9]{0,17}),'
    r'"data_end":(0|[1-9][0-9]{0,17}),"data_start":(0|[1-9][0-9]{0,17}),'
    r'"raw_sha256":"([0-9a-f]{64})"\}([,\]])'
)
CHUNK_TEXT = re.compile(_CHUNK_PATTERN)
_CHUNK_BYTES = re.compile(_CHUNK_PATTERN.encode("ascii"))


def _digest_bytes(digest: str) -> bytes:
    if type(digest) is not str or not SHA256_HEX.fullmatch(digest):
        raise ValueError(f"a digest must be 64 lowercase hex digits, got {digest!r}")
    return bytes.fromhex(digest)


def shard_entries(
    plans: Sequence[ShardPlan],
    digests: Sequence[str],
    tensor_digests: Sequence[Sequence[str]] | None = None,
) -> tuple[ShardEntry, ...]:
    """Manifest entries for planned shards, the SHA-256 of each one's blob and (schema 2)
    of each of its tensors."""
    if len(plans) != len(digests):
        raise ValueError(f"{len(plans)} shard plans but {len(digests)} blob digests")
    if tensor_digests is None:
        tensor_digests = [None] * len(plans)
    for plan, per_tensor in zip(plans, tensor_digests, strict=True):
        if per_tensor is not None and len(per_tensor) != len(plan.tensors):
            raise ValueError(
                f"shard {plan.index} has {len(plan.tensors)} tensors but {len(per_tensor)} digests"
            )
    return tuple(
        ShardEntry(
            index=plan.index,
            data_start=plan.data_start,
            data_end=plan.data_end,
            tensors=plan.tensors,
            blob_size=plan.blob_size,
            blob_sha256=digest,
            blob_data_offset=len(plan.prefix),
            tensor_sha256=None if per_tensor is None else tuple(per_tensor),
        )
        for plan, digest, per_tensor in zip(plans, digests, tensor_digests, strict=True)
    )


def chunk_entries(
    plans: Sequence[ChunkPlan], digests: Sequence[tuple[str, str, int]]
) -> tuple[ChunkEntry, ...]:
    """Manifest entries for planned chunks and, per chunk, (raw SHA-256, encoded SHA-256,
    encoded size)."""
    if len(plans) != len(digests):
        raise ValueError(f"{len(plans)} chunk plans but {len(digests)} digests")
    return tuple(
        ChunkEntry(plan.index, plan.data_start, plan.data_end, raw, blob_size, blob)
        for plan, (raw, blob, blob_size) in zip(plans, digests, strict=True)
    )
