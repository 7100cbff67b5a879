"""The manifest: everything needed to rebuild one version of a checkpoint.

One manifest per version, kept in Redis and on the nodes (so losing Redis
loses nothing). It holds the source's header bytes verbatim, and per shard
the range of the source data section it carries and the blob that carries
it, so 8-byte length + header + every shard's range in order is the source,
byte for byte.

The JSON is versioned (`schema_version`) and canonical (sorted keys, no
spaces): the same manifest always serialises to the same bytes.

Schema 2 adds, per shard, the SHA-256 of each tensor's bytes (`tensor_sha256`,
in the order of `tensors`), computed in the same pass that hashes the blob at
plan time, so a load of a few tensors can verify a byte range instead of
fetching whole shards. Schema 1 manifests (no such digests) are still read; a
partial load of one of them fetches and verifies the whole shards it needs.

Schema 3 lists chunks instead of shards (coordinator/plan/chunks.py): per chunk its
range of the data section, the SHA-256 of its raw bytes (its address, the same in every
version that holds those bytes) and the size and SHA-256 of the encoded chunk a node
keeps (coordinator/dataplane/codec.py). Every schema is read; a store writes schema 3
by default, schema 2 with --shards N or SMOLTORRENT_CHUNKS=0.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import struct
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any, NoReturn

from coordinator.plan.chunks import ChunkPlan
from coordinator.plan.planner import ShardPlan, blob_prefix
from coordinator.plan.safetensors_header import (
    LENGTH_PREFIX_BYTES,
    CheckpointHeader,
    TensorInfo,
    checked_data_size,
    parse_header,
)
from smoltorrent import defaults
from smoltorrent.errors import CheckpointFormatError, ManifestError, UnsafeNameError, UsageError

SCHEMA_VERSION = 3  # the newest: chunks
SHARD_SCHEMA_VERSION = 2  # the newest of whole shards
READABLE_SCHEMAS = (1, 2, 3)  # 1: before per-tensor digests; 3: chunks
_VERSION_ID_DOMAIN = b"smoltorrent version v1\0"  # keeps these digests apart from any other
# A chunked version's id hashes raw chunk digests, never blob digests: another domain, so
# it can never equal a whole-shard version's id
_CHUNKED_VERSION_ID_DOMAIN = b"smoltorrent chunked version v1\0"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


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


_DIGEST_BYTES = 32  # a SHA-256


class _Columns:
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
        """One chunk's object matched by _CHUNK_TEXT or _CHUNK_BYTES; what follows it."""
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
        columns = _Columns()
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
            at = i * _DIGEST_BYTES
            out.write(
                b'%s{"blob_sha256":"%s","blob_size":%d,"data_end":%d,"data_start":%d,'
                b'"raw_sha256":"%s"}'
                % (
                    b"," if i else b"",
                    binascii.hexlify(self._blob[at : at + _DIGEST_BYTES]),
                    size,
                    end,
                    start,
                    binascii.hexlify(self._raw[at : at + _DIGEST_BYTES]),
                )
            )
        out.write(b"]")

    def json_size(self) -> int:
        """How many bytes write_json writes."""
        fixed = len(b'{"blob_sha256":"","blob_size":,"data_end":,"data_start":,"raw_sha256":""}')
        count = len(self)
        digits = sum(len(str(value)) for part in (self._starts, self._ends, self._sizes)
                     for value in part)  # fmt: skip
        return 2 + max(count - 1, 0) + count * (fixed + 4 * _DIGEST_BYTES) + digits

    @classmethod
    def from_canonical_json(cls, data: bytes | str, start: int) -> tuple[ChunkTable, int] | None:
        """The chunk list that opens at `start` of a manifest's JSON text, read straight
        into a table when it is written as to_json writes it (every manifest smoltorrent
        stores), with the offset just past its closing bracket; None when it is not
        (spaces, another key order, a value _parse_chunk would not take, a number past
        18 digits): the caller then decodes the whole text as JSON. No object per chunk is
        kept, nor a JSON document of the whole list built."""
        pattern, close = (_CHUNK_BYTES, b"]") if isinstance(data, bytes) else (_CHUNK_TEXT, "]")
        columns = _Columns()
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
        at = i * _DIGEST_BYTES
        return ChunkEntry(
            i,
            self._starts[i],
            self._ends[i],
            self._raw[at : at + _DIGEST_BYTES].hex(),
            self._sizes[i],
            self._blob[at : at + _DIGEST_BYTES].hex(),
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
_CHUNK_TEXT = re.compile(_CHUNK_PATTERN)
_CHUNK_BYTES = re.compile(_CHUNK_PATTERN.encode("ascii"))


def _digest_bytes(digest: str) -> bytes:
    if type(digest) is not str or not _SHA256_HEX.fullmatch(digest):
        raise ValueError(f"a digest must be 64 lowercase hex digits, got {digest!r}")
    return bytes.fromhex(digest)


@dataclass(frozen=True)
class Manifest:
    name: str  # path relative to the watched root, e.g. "grpo/run1/step_100.safetensors"
    version_id: str  # 64 hex, from version_id_for or chunked_version_id
    source_size: int
    header_bytes: bytes  # the source's N header bytes, verbatim
    replicas: int
    shards: tuple[ShardEntry, ...]  # schemas 1 and 2; empty in schema 3
    created_at: float  # unix seconds
    schema_version: int = SHARD_SCHEMA_VERSION
    # Schema 3; any sequence of ChunkEntry given is kept as a ChunkTable.
    chunks: ChunkTable | tuple[ChunkEntry, ...] = ()
    # The sequence number of the latest store request for this version, in the copies
    # the nodes keep (written at commit and again when a later request makes it current:
    # a rollback), so a rebuild orders a name's versions by request, not by creation.
    # 0: not recorded (Redis keeps it in the version's hash; older manifests).
    seq: int = 0
    # Its pin and labels, in the copies the nodes keep, so a rebuild brings them back;
    # marks_seq: the number (from the one counter) of their last change, or of its R's
    # (Versions.set_replicas), so of a rebuild's copies the one last written says them and
    # its R (coordinator/state/marks.py). 0: none recorded.
    marks_seq: int = 0
    pinned: bool = False
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.chunked and self.shards) or (not self.chunked and self.chunks):
            raise ValueError(f"a schema {self.schema_version} manifest cannot hold that")
        if not isinstance(self.chunks, ChunkTable):
            object.__setattr__(self, "chunks", ChunkTable.of(self.chunks))

    @property
    def chunked(self) -> bool:
        return self.schema_version >= 3

    @property
    def entries(self) -> tuple[ShardEntry, ...] | tuple[ChunkEntry, ...]:
        """Every blob of this version as its manifest entry (a chunk or a shard), in order:
        what transfers, placement, references and the sweeps count by index, whichever
        the schema. Each has index, data_start, data_end, blob_size and blob_sha256."""
        return self.chunks if self.chunked else self.shards

    @property
    def blobs(self) -> tuple[tuple[str, int], ...]:
        """(SHA-256, size) of every blob a node keeps for this version, in order."""
        return tuple((entry.blob_sha256, entry.blob_size) for entry in self.entries)

    def first_uses(self) -> tuple[int, ...]:
        """For each entry, the index of the first entry with the same blob (itself, unless
        its bytes repeat: byte-identical chunks, as every norm of a freshly initialised
        model). A store delivers each blob once, as its first entry, and that delivery
        settles every entry using it: two deliveries of one blob raced each other."""
        first: dict[str, int] = {}
        return tuple(first.setdefault(e.blob_sha256, i) for i, e in enumerate(self.entries))

    def repeats(self) -> dict[int, list[int]]:
        """First entry of a blob used more than once -> the later entries using it."""
        out: dict[int, list[int]] = {}
        for index, first in enumerate(self.first_uses()):
            if first != index:
                out.setdefault(first, []).append(index)
        return out

    def tensor_count(self) -> int:
        """How many tensors the source holds (a chunked manifest names none itself: its
        header does)."""
        if not self.chunked:
            return sum(len(s.tensors) for s in self.shards)
        return len(self.header().tensors)

    def header(self) -> CheckpointHeader:
        """The source's header, parsed from the bytes this manifest keeps."""
        return _source_header(self)

    def entry_of(self, tensor: TensorInfo) -> int | None:
        """The index of the shard, or first chunk, holding `tensor`'s bytes (None for a
        tensor of no bytes in a chunked manifest: no chunk holds it)."""
        for entry in self.entries:
            if isinstance(entry, ShardEntry) and tensor.name in entry.tensors:
                return entry.index
            if isinstance(entry, ChunkEntry) and entry.data_start <= tensor.start < entry.data_end:
                return entry.index
        return None

    @property
    def data_start(self) -> int:
        return LENGTH_PREFIX_BYTES + len(self.header_bytes)

    def content_version_id(self) -> str:
        """The version id its header and digests make (what a store gives it): equal to
        version_id unless the copy was forged or damaged in a way its parse cannot see."""
        if self.chunked:
            return chunked_version_id(self.header_bytes, [c.raw_sha256 for c in self.chunks])
        return version_id_for(self.header_bytes, [s.blob_sha256 for s in self.shards])

    def storage_key(self) -> str:
        """The key of this manifest in a node's manifest store: 32 hex, safe as a file name.

        It covers the name as well as the content: two names holding identical
        bytes (latest.safetensors copied to step_100.safetensors) are two
        manifests and must not overwrite each other on a node. 128 bits keep
        collisions out of reach while the key stays short.
        """
        return storage_key(self.name, self.version_id)

    def to_json(self) -> bytes:
        """The canonical JSON (sorted keys, no spaces, ASCII), written a field and a chunk
        at a time: the same bytes as json.dumps of the whole document (tests say so), but
        a store or a commit of thousands of chunks never holds a dict per chunk, nor the
        JSON twice (as text, then as bytes), at once."""
        values = self._field_values()
        out = io.BytesIO()
        if self.chunked:
            # Its final size written first, so the buffer is allocated once, exactly, and
            # handed out as it is: grown a write at a time, it was reallocated (copied,
            # beside freed copies) a dozen times for a 16 GB checkpoint's 2 MB of JSON.
            keys = [*values, "header_bytes", "chunks"]
            size = 2 + len(keys) - 1 + self.chunks.json_size()  # braces, commas, the list
            size += sum(len(_json(key)) + 1 for key in keys)  # keys, colons
            size += sum(map(len, values.values())) + 2 + _base64_size(self.header_bytes)
            out.seek(size - 1)
            out.write(b"}")
            out.seek(0)
        self._write_json(out, values)
        if self.chunked and out.tell() != size:
            raise RuntimeError(f"a manifest's JSON took {out.tell()} bytes, not {size}")
        return out.getvalue()

    def write_json_pieces(self, send: Callable[[bytes], object], piece: int) -> None:
        """to_json's bytes handed to `send` in order, in pieces of about `piece` bytes (the
        last shorter), never all at once: a 16 GB checkpoint's is 2 MB."""
        out = _Pieces(send, piece)
        self._write_json(out, self._field_values())
        out.flush()

    def _field_values(self) -> dict[str, bytes]:
        """Every top-level field but the header and the entries, as JSON."""
        fields: dict[str, Any] = {
            "schema_version": self.schema_version,
            "name": self.name,
            "version_id": self.version_id,
            "source_size": self.source_size,
            "replicas": self.replicas,
            "created_at": self.created_at,
        }
        if self.seq:
            fields["seq"] = self.seq
        if self.marks_seq:
            fields["marks"] = {
                "seq": self.marks_seq,
                "pinned": self.pinned,
                "labels": list(self.labels),
            }
        return {key: _json(value) for key, value in fields.items()}

    def _write_json(self, out: io.BytesIO | _Pieces, values: dict[str, bytes]) -> None:
        for position, key in enumerate(sorted([*values, "header_bytes", self._entries_key])):
            out.write(b"{" if position == 0 else b",")
            out.write(_json(key))
            out.write(b":")
            if key == "header_bytes":
                # Base64's alphabet holds nothing JSON escapes: the bytes go in as they are,
                # encoded a slice at a time.
                out.write(b'"')
                header = self.header_bytes
                for start in range(0, len(header), _BASE64_SLICE):
                    out.write(base64.b64encode(header[start : start + _BASE64_SLICE]))
                out.write(b'"')
            elif key == self._entries_key:
                self._write_entries(out)
            else:
                out.write(values[key])
        out.write(b"}")

    @property
    def _entries_key(self) -> str:
        return "chunks" if self.chunked else "shards"

    def _write_entries(self, out: io.BytesIO) -> None:
        """The chunks (or shards) list of to_json, one entry encoded at a time."""
        if self.chunked:
            self.chunks.write_json(out)
            return
        out.write(b"[")
        for position, entry in enumerate(self.entries):
            if position:
                out.write(b",")
            out.write(_json(_shard_document(entry)))
        out.write(b"]")

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Parse and validate; ManifestError names the first problem found."""
        return _parse_manifest([data])

    @classmethod
    def from_json_pieces(cls, pieces: Iterator[str]) -> Manifest | None:
        """from_json of the text the pieces make, in order, read as they come: a chunked
        manifest's chunk list goes straight into its ChunkTable, so the whole text (2 MB
        for a 16 GB checkpoint's 4,629 chunks) is never held at once, only a piece and the
        fields after the list. None, the rest of the pieces left unread, when the text is
        not written as to_json writes it: the caller then reads it whole (from_json), which
        names what is wrong. ManifestError as from_json for a manifest that does not hold."""
        document = _document_from_pieces(pieces)
        return None if document is None else _manifest_of(document)

    @classmethod
    def from_json_taken(cls, held: list[bytes | str]) -> Manifest:
        """from_json of the one JSON text in `held`, taken out of it once decoded: with no
        other reference to it (a reply just read from Redis), the text (megabytes for
        thousands of chunks) is freed before the entries are built and checked against
        the header, instead of lasting through the whole parse."""
        return _parse_manifest(held)


# Header bytes base64-encoded a slice at a time: a multiple of 3, so the slices' encodings
# join into the whole one's.
_BASE64_SLICE = 3 * 16 * 1024


def _base64_size(data: bytes) -> int:
    return 4 * ((len(data) + 2) // 3)


class _Pieces:
    """A writer that hands what it was given on in pieces of at least `piece` bytes (the
    last one shorter)."""

    def __init__(self, send: Callable[[bytes], object], piece: int) -> None:
        self._send, self._piece, self._out = send, piece, io.BytesIO()

    def write(self, data: bytes) -> None:
        self._out.write(data)
        if self._out.tell() >= self._piece:
            self.flush()

    def flush(self) -> None:
        if self._out.tell():
            self._send(self._out.getvalue())
            self._out = io.BytesIO()


def _json(value: Any) -> bytes:
    """One value as Manifest.to_json writes it: canonical JSON (sorted keys, no spaces,
    ASCII). Strings and plain ints, the bulk of a manifest, skip json.dumps."""
    if type(value) is str:
        return encode_basestring_ascii(value).encode("ascii")
    if type(value) is int:
        return int.__repr__(value).encode("ascii")
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("ascii")


def _shard_document(shard: ShardEntry) -> dict[str, Any]:
    return {
        "index": shard.index,
        "data_start": shard.data_start,
        "data_end": shard.data_end,
        "tensors": list(shard.tensors),
        "blob_size": shard.blob_size,
        "blob_sha256": shard.blob_sha256,
        "blob_data_offset": shard.blob_data_offset,
    } | ({} if shard.tensor_sha256 is None else {"tensor_sha256": list(shard.tensor_sha256)})


def check_name(name: str) -> str:
    """A checkpoint name as given, or UsageError if it holds a control character: a newline
    or a tab would split or shift its row in `ls` (one line per version in a pipe, cells
    split by tabs) and in every log line that names it."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise UsageError(
            f"the checkpoint name {name!r} holds a control character (newline, tab, ...);"
            " choose another (--name on the command line)"
        )
    return name


def storage_key(name: str, version_id: str) -> str:
    """The version key of `version_id` under `name` (see Manifest.storage_key)."""
    digest = hashlib.sha256(f"{name}\0{version_id}".encode()).hexdigest()
    return digest[: defaults.VERSION_KEY_CHARS]


_VERSION_KEY = re.compile(f"[0-9a-f]{{{defaults.VERSION_KEY_CHARS}}}")


def check_version_key(vkey: object) -> str:
    """`vkey` if it is a version key as storage_key makes them, else UnsafeNameError. A
    key from a broker message or Redis names a directory on the source's host (the spool's),
    so '/home/u' or '..' must never pass for one."""
    if not isinstance(vkey, str) or not _VERSION_KEY.fullmatch(vkey):
        raise UnsafeNameError(
            f"refusing the version key {str(vkey)[:80]!r}: a version key is"
            f" {defaults.VERSION_KEY_CHARS} lowercase hex digits. A message or a Redis"
            " value that says otherwise was not written by smoltorrent."
        )
    return vkey


def version_id_for(header_bytes: bytes, blob_digests: Sequence[str]) -> str:
    """SHA-256 over the header and the ordered blob digests, each length-framed.

    Header and blobs together determine every byte of the source, so equal
    ids mean equal content; the framing keeps two different (header,
    digests) pairs from hashing the same concatenation.
    """
    return _version_id(_VERSION_ID_DOMAIN, header_bytes, blob_digests)


def chunked_version_id(header_bytes: bytes, raw_digests: Sequence[str]) -> str:
    """A chunked version's id: as version_id_for, over the chunks' raw digests, so it does
    not depend on how the chunks were encoded."""
    return _version_id(_CHUNKED_VERSION_ID_DOMAIN, header_bytes, raw_digests)


def _version_id(domain: bytes, header_bytes: bytes, digests: Sequence[str]) -> str:
    digest = hashlib.sha256(domain)
    digest.update(struct.pack("<Q", len(header_bytes)))
    digest.update(header_bytes)
    digest.update(struct.pack("<Q", len(digests)))
    for one in digests:
        if not _SHA256_HEX.fullmatch(one):
            raise ValueError(f"a digest must be 64 lowercase hex digits, got {one!r}")
        digest.update(bytes.fromhex(one))
    return digest.hexdigest()


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


def source_prefix(manifest: Manifest) -> bytes:
    """The first data_start bytes of the source: 8-byte LE header length + header."""
    return struct.pack("<Q", len(manifest.header_bytes)) + manifest.header_bytes


def blob_prefixes(manifest: Manifest) -> tuple[bytes, ...]:
    """Each shard's blob header, rebuilt from the manifest alone."""
    header = _source_header(manifest)
    by_name = {tensor.name: tensor for tensor in header.tensors}
    return tuple(
        blob_prefix([by_name[name] for name in shard.tensors]) for shard in manifest.shards
    )


@dataclass(frozen=True, slots=True)
class BlobSpan:
    """What sending one shard's blob from its source takes, and nothing more: its digest and
    size, its own header (prefix) and the byte range of the source after it. A transfer task
    reads this for its shard alone, not the whole manifest (megabytes for thousands of
    tensors), so its memory follows its shard, not the checkpoint."""

    index: int
    digest: str
    size: int
    prefix: bytes
    offset: int  # in the source file
    length: int
    # An encoded chunk (coordinator/dataplane/codec.py): the blob is the encoding of the
    # source range, not prefix + range, kept at this path of the source's host once the
    # store encoded it ("": not kept, encode it again). None: the blob is prefix + range.
    spool: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "index": self.index,
                "digest": self.digest,
                "size": self.size,
                "prefix": base64.b64encode(self.prefix).decode("ascii"),
                "offset": self.offset,
                "length": self.length,
            }
            | ({} if self.spool is None else {"spool": self.spool}),
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> BlobSpan:
        try:
            document = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            _fail(f"a blob span is not JSON ({error})")
        given = document.keys() if isinstance(document, dict) else set()
        fields = _fields(
            document,
            {"index", "digest", "size", "prefix", "offset", "length"} | ({"spool"} & given),
            "a span",
        )
        spool = fields.get("spool")
        if spool is not None and not isinstance(spool, str):
            _fail(f"a blob span's spool is {spool!r}, not a path")
        try:
            prefix = base64.b64decode(fields["prefix"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            _fail("a blob span's prefix is not base64")
        span = cls(
            index=_count(fields, "index", "a span"),
            digest=_sha256(fields, "digest", "a span"),
            size=_count(fields, "size", "a span"),
            prefix=prefix,
            offset=_count(fields, "offset", "a span", LENGTH_PREFIX_BYTES),
            length=_count(fields, "length", "a span"),
            spool=spool,
        )
        if span.spool is None and span.size != len(span.prefix) + span.length:
            _fail(f"blob span {span.index}: size {span.size} is not its prefix plus its range")
        return span


def blob_spans(manifest: Manifest, prefixes: Sequence[bytes] | None = None) -> tuple[BlobSpan, ...]:
    """Every shard's span; `prefixes` when the caller has them (rebuilt from the manifest's
    header otherwise)."""
    prefixes = blob_prefixes(manifest) if prefixes is None else prefixes
    return tuple(
        BlobSpan(
            index=shard.index,
            digest=shard.blob_sha256,
            size=shard.blob_size,
            prefix=prefix,
            offset=manifest.data_start + shard.data_start,
            length=shard.data_end - shard.data_start,
        )
        for shard, prefix in zip(manifest.shards, prefixes, strict=True)
    )


@dataclass(frozen=True)
class VersionBlobs:
    """What a sweep over every version needs of one manifest: its name, its replicas and
    each shard's or chunk's (blob digest, blob size)."""

    name: str
    replicas: int
    blobs: tuple[tuple[str, int], ...]

    @classmethod
    def from_json(cls, data: bytes | str) -> VersionBlobs:
        """Read from a manifest's JSON, each field type-checked, without rebuilding its
        header to check the shards against it (most of a full parse's time: the manifest
        was checked whole when it was recorded)."""
        try:
            document = json.loads(data)
        except _NOT_JSON as error:
            _fail(f"not JSON ({error})")
        fields = _fields(document, _manifest_fields(document), "manifest", _OPTIONAL_FIELDS)
        entries = fields.get("chunks", fields.get("shards"))
        kind = "chunk" if "chunks" in fields else "shard"
        if not isinstance(fields["name"], str) or not isinstance(entries, list):
            _fail(f"its name or {kind}s have the wrong type")
        blobs = []
        for entry in entries:
            if not isinstance(entry, dict):
                _fail(f"a {kind} is not a JSON object")
            what = f"{kind} {len(blobs)}"
            blobs.append((_sha256(entry, "blob_sha256", what), _count(entry, "blob_size", what)))
        return cls(fields["name"], _count(fields, "replicas", "manifest", 1), tuple(blobs))


def _source_header(manifest: Manifest) -> CheckpointHeader:
    length = struct.pack("<Q", len(manifest.header_bytes))
    source = f"manifest of {manifest.name}"
    return parse_header(length, manifest.header_bytes, manifest.source_size, source=source)


# --- parsing and validation -------------------------------------------------

_MANIFEST_FIELDS = {
    "schema_version",
    "name",
    "version_id",
    "source_size",
    "header_bytes",
    "replicas",
    "created_at",
}
# absent from manifests that do not record them
_OPTIONAL_FIELDS = frozenset({"seq", "marks"})
# What json.loads raises on text that is not JSON smoltorrent could have written, besides
# JSONDecodeError (a ValueError too): a number of over 4,300 digits (ValueError), nesting
# deeper than the stack (RecursionError). A node's copy is input like any other: every one
# of these is a ManifestError, so a rebuild or a crosscheck skips that copy and goes on.
_NOT_JSON = (ValueError, UnicodeDecodeError, RecursionError)
# A version label, as `smoltorrent tag` takes it (and a node's copy of the marks must hold)
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_CHUNK_FIELDS = {"data_start", "data_end", "raw_sha256", "blob_size", "blob_sha256"}
_SHARD_FIELDS = {
    "index",
    "data_start",
    "data_end",
    "tensors",
    "blob_size",
    "blob_sha256",
    "blob_data_offset",
}


def _manifest_fields(document: Any) -> set[str]:
    """The fields a manifest of its schema has: chunks from schema 3 on, shards before."""
    chunked = isinstance(document, dict) and type(document.get("schema_version")) is int
    chunked = chunked and document["schema_version"] >= 3
    return _MANIFEST_FIELDS | {"chunks" if chunked else "shards"}


def _fail(problem: str) -> NoReturn:
    raise ManifestError(
        f"invalid manifest: {problem}. It is corrupt or was not written by smoltorrent; "
        "read the copy another node keeps, or store the checkpoint again."
    )


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            _fail(f"a JSON object repeats the key {key!r}")
        result[key] = value
    return result


def _fields(
    document: Any, expected: set[str], what: str, optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(document, dict):
        _fail(f"{what} is not a JSON object")
    if missing := expected - document.keys():
        _fail(f"{what} lacks {', '.join(sorted(missing))}")
    if unknown := document.keys() - expected - optional:
        _fail(f"{what} has unknown fields {', '.join(sorted(unknown))}")
    return document


def _count(
    document: dict[str, Any], key: str, what: str, minimum: int = 0, maximum: int | None = None
) -> int:
    value = document[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(f"{what} {key} is {_shown(value)}, not an integer >= {minimum}")
    if maximum is not None and value > maximum:
        _fail(f"{what} {key} is {_shown(value)}, over {maximum}")
    return value


def _shown(value: Any) -> str:
    """A value for an error message, cut short: a hostile one may be thousands of digits."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else "huge"
    return text if len(text) <= 80 else text[:77] + "..."


def _sha256(document: dict[str, Any], key: str, what: str) -> str:
    value = document[key]
    if not isinstance(value, str) or not _SHA256_HEX.fullmatch(value):
        _fail(f"{what} {key} is {value!r}, not 64 lowercase hex digits")
    return value


def _parse_marks(marks: Any) -> dict[str, Any]:
    """A node's copy's pin and labels: {"seq", "pinned", "labels"}."""
    if not isinstance(marks, dict) or set(marks) != {"seq", "pinned", "labels"}:
        _fail(f"marks is {_shown(marks)}, not {{seq, pinned, labels}}")
    labels = marks["labels"]
    if not isinstance(marks["pinned"], bool) or not isinstance(labels, list):
        _fail(f"marks {_shown(marks)} have the wrong types")
    if not all(isinstance(label, str) and LABEL.fullmatch(label) for label in labels):
        _fail(f"marks labels {_shown(labels)} are not each a label `smoltorrent tag` takes")
    seq = _count(marks, "seq", "marks", 1, defaults.MAX_SEQ)
    return {"marks_seq": seq, "pinned": marks["pinned"], "labels": tuple(labels)}


_LATEST_CREATED_AT = 2**40  # unix seconds (year ~36,800): past it, not a time we wrote


_CHUNKS_OPENING = '{"chunks":['  # to_json's first key, sorted, is a chunked manifest's list


def _canonical_document(data: bytes | str) -> dict[str, Any] | None:
    """The JSON document of a chunked manifest written as to_json writes it, its chunks
    read straight into a ChunkTable (in the document's "chunks") and the rest decoded as
    JSON; None when the text is not in that form, or not JSON after its chunks, for the
    whole text's decode to say what is wrong as it always did."""
    opening = _CHUNKS_OPENING.encode("ascii") if isinstance(data, bytes) else _CHUNKS_OPENING
    if not data.startswith(opening):
        return None
    read = ChunkTable.from_canonical_json(data, len(opening) - 1)
    if read is None:
        return None
    table, end = read
    document: dict[str, Any] = {"chunks": table}
    try:
        if isinstance(data, bytes):  # a node's copy: what follows the list, as text
            data, end = data[end:].decode(), 0
        return document if _decode_fields(data, end, document) else None
    except (*_NOT_JSON, ManifestError):
        return None


def _decode_fields(data: str, position: int, document: dict[str, Any]) -> bool:
    """The fields of a manifest's object from `position` (just past its chunk list) to its
    end into `document`, each value decoded in place, without copying the text after the
    chunks (the header's base64 is most of it); False if the object does not go on as
    to_json writes it (`,"key":value` up to the closing brace that ends the text)."""
    scan = _field_scanner()
    try:
        while data[position] == ",":
            if data[position + 1] != '"':
                return False
            key, position = scan(data, position + 1)
            if data[position] != ":" or key in document:
                return False
            document[key], position = scan(data, position + 1)
    except (IndexError, StopIteration):
        return False
    return position == len(data) - 1 and data[position] == "}"


_scanner: list = []  # the one JSON value scanner of _decode_fields, made at its first use


def _field_scanner():
    if not _scanner:
        decoder = json.JSONDecoder(object_pairs_hook=_reject_duplicate_keys)
        _scanner.append(decoder.scan_once)
    return _scanner[0]


def _parse_manifest(held: list[bytes | str]) -> Manifest:
    """Manifest.from_json_taken."""
    data = held.pop()
    document = _canonical_document(data)
    try:
        if document is None:  # not to_json's form: any JSON form, checked field by field
            document = json.loads(data, object_pairs_hook=_reject_duplicate_keys)
    except _NOT_JSON as error:
        _fail(f"not JSON ({error})")
    del data
    return _manifest_of(document)


# The most text one chunk's object (with the comma or bracket after it) takes in to_json's
# form: a piece of the text that ends in less than this may cut one short.
_CHUNK_TEXT_MOST = (
    len('{"blob_sha256":"","blob_size":,"data_end":,"data_start":,"raw_sha256":""}')
    + 4 * _DIGEST_BYTES
    + 3 * 18
    + 1
)


def _document_from_pieces(pieces: Iterator[str]) -> dict[str, Any] | None:
    """_canonical_document of the text the pieces make, read a piece at a time."""
    buffer, position = "", len(_CHUNKS_OPENING)
    while len(buffer) <= position:
        more = next(pieces, None)
        if more is None:
            return None
        buffer += more
    if not buffer.startswith(_CHUNKS_OPENING):
        return None
    columns = _Columns()
    closed = buffer[position] == "]"
    position += closed
    while not closed:
        found = _CHUNK_TEXT.match(buffer, position)
        if found is None:
            more = None if len(buffer) - position >= _CHUNK_TEXT_MOST else next(pieces, None)
            if more is None:
                return None
            buffer, position = buffer[position:] + more, 0
            continue
        position, closed = found.end(), columns.add_match(found) == "]"
    rest = buffer[position:]
    del buffer
    for more in pieces:
        rest += more  # grown in place: no list of the pieces beside their join
    document: dict[str, Any] = {"chunks": columns.table()}
    try:
        return document if _decode_fields(rest, 0, document) else None
    except (*_NOT_JSON, ManifestError):
        return None


def _manifest_of(document: Any) -> Manifest:
    """The manifest a decoded JSON document holds, every field checked."""
    if not isinstance(document, dict):
        _fail("the top level is not a JSON object")
    schema = document.get("schema_version")
    if type(schema) is not int or schema not in READABLE_SCHEMAS:
        newer = isinstance(schema, int) and schema > SCHEMA_VERSION
        raise ManifestError(
            f"unknown manifest schema_version {schema!r}: this smoltorrent reads versions "
            + ", ".join(map(str, READABLE_SCHEMAS))
            + ("; upgrade smoltorrent to read it." if newer else "; the manifest is not ours.")
        )
    fields = _fields(document, _manifest_fields(document), "manifest", _OPTIONAL_FIELDS)
    name = fields["name"]
    if not isinstance(name, str) or not name:
        _fail(f"name is {name!r}, not a non-empty string")
    try:
        header_bytes = base64.b64decode(fields["header_bytes"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        _fail("header_bytes is not base64")
    created_at = fields["created_at"]
    if (
        not isinstance(created_at, int | float)
        or isinstance(created_at, bool)
        or not 0 <= created_at <= _LATEST_CREATED_AT  # also no float could hold it
    ):
        _fail(f"created_at is {_shown(created_at)}, not unix seconds")
    kind = "chunks" if "chunks" in fields else "shards"
    if not isinstance(fields[kind], list | ChunkTable):
        _fail(f"{kind} is not a list")
    chunks = fields.get("chunks", [])
    if not isinstance(chunks, ChunkTable):
        chunks = _chunk_table(_parse_chunk(c, i) for i, c in _consumed(chunks))
    manifest = Manifest(
        name=name,
        version_id=_sha256(fields, "version_id", "manifest"),
        source_size=_count(fields, "source_size", "manifest", LENGTH_PREFIX_BYTES),
        header_bytes=header_bytes,
        replicas=_count(fields, "replicas", "manifest", 1),
        shards=tuple(_parse_shard(shard, schema) for shard in fields.get("shards", ())),
        created_at=float(created_at),
        schema_version=schema,
        chunks=chunks,
        seq=_count(fields, "seq", "manifest", 0, defaults.MAX_SEQ) if "seq" in fields else 0,
        **(_parse_marks(fields["marks"]) if "marks" in fields else {}),
    )
    # The JSON document goes before the header is parsed to check the entries against it:
    # the two at once were most of a commit's or a gather's peak for thousands of chunks.
    del document, fields, chunks
    if manifest.chunked:
        _check_chunks(manifest)
    else:
        _check_against_header(manifest)
    return manifest


def _chunk_table(entries: Iterable[ChunkEntry]) -> ChunkTable:
    try:
        return ChunkTable.of(entries)
    except OverflowError:
        _fail("a chunk's range or size is past 2**63 bytes")


def _consumed(items: list[Any]) -> Iterator[tuple[int, Any]]:
    """enumerate(items), each item dropped from the list once the next is asked for: a
    chunk's JSON object is freed as soon as its entry is built, so the parse never holds
    both for every chunk."""
    for index in range(len(items)):
        item, items[index] = items[index], None
        yield index, item


def _parse_chunk(document: Any, index: int) -> ChunkEntry:
    what = f"chunk {index}"
    fields = _fields(document, _CHUNK_FIELDS, f"a {what}")
    return ChunkEntry(
        index=index,
        data_start=_count(fields, "data_start", what),
        data_end=_count(fields, "data_end", what),
        raw_sha256=_sha256(fields, "raw_sha256", what),
        blob_size=_count(fields, "blob_size", what, 1),
        blob_sha256=_sha256(fields, "blob_sha256", what),
    )


def _check_chunks(manifest: Manifest) -> None:
    """The chunks must tile the source's data section in order, each holding bytes."""
    try:
        data_size = checked_data_size(
            struct.pack("<Q", len(manifest.header_bytes)),
            manifest.header_bytes,
            manifest.source_size,
            source=f"manifest of {manifest.name}",
        )
    except CheckpointFormatError as error:
        _fail(f"its source header does not hold up: {error}")
    covered = 0
    for index, (start, end) in enumerate(manifest.chunks.ranges()):
        if start != covered or end <= start:
            _fail(f"chunk {index} covers {start}-{end}; the chunks before it end at {covered}")
        covered = end
    if covered != data_size:
        _fail(f"its chunks cover {covered} bytes of a {data_size}-byte data section")


def _parse_shard(document: Any, schema: int) -> ShardEntry:
    # Schema 2 shards may carry per-tensor digests (absent when converted from schema 1).
    given = document.keys() if isinstance(document, dict) and schema >= 2 else set()
    fields = _fields(document, _SHARD_FIELDS | ({"tensor_sha256"} & given), "a shard")
    index = _count(fields, "index", "a shard")
    what = f"shard {index}"
    tensors = fields["tensors"]
    if not isinstance(tensors, list) or not tensors or not all(isinstance(t, str) for t in tensors):
        _fail(f"{what} tensors is {tensors!r}, not a non-empty list of names")
    per_tensor = fields.get("tensor_sha256")
    if "tensor_sha256" in fields and (
        not isinstance(per_tensor, list)
        or len(per_tensor) != len(tensors)
        or not all(isinstance(d, str) and _SHA256_HEX.fullmatch(d) for d in per_tensor)
    ):
        _fail(f"{what} tensor_sha256 is not one SHA-256 (64 lowercase hex) per tensor")
    return ShardEntry(
        index=index,
        data_start=_count(fields, "data_start", what),
        data_end=_count(fields, "data_end", what),
        tensors=tuple(tensors),
        blob_size=_count(fields, "blob_size", what),
        blob_sha256=_sha256(fields, "blob_sha256", what),
        blob_data_offset=_count(fields, "blob_data_offset", what, LENGTH_PREFIX_BYTES),
        tensor_sha256=None if per_tensor is None else tuple(per_tensor),
    )


def _check_against_header(manifest: Manifest) -> None:
    """The shards must tile the source's tensors in order, exactly as its header lays them out."""
    try:
        header = _source_header(manifest)
    except CheckpointFormatError as error:
        _fail(f"its source header does not hold up: {error}")
    tensors = iter(header.tensors)
    for position, shard in enumerate(manifest.shards):
        what = f"shard {shard.index}"
        if shard.index != position:
            _fail(f"{what} is listed at position {position}")
        if shard.blob_size != shard.blob_data_offset + shard.data_end - shard.data_start:
            _fail(f"{what} blob_size {shard.blob_size} does not match its header and range")
        members = [next(tensors, None) for _ in shard.tensors]
        if [tensor and tensor.name for tensor in members] != list(shard.tensors):
            _fail(f"{what} tensors do not follow the source header's data order")
        if (shard.data_start, shard.data_end) != (members[0].start, members[-1].end):
            _fail(f"{what} range {shard.data_start}-{shard.data_end} does not match its tensors")
    if leftover := [tensor.name for tensor in tensors]:
        _fail(f"no shard holds the tensors {', '.join(leftover[:3])}")
