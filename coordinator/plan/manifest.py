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

Here: the Manifest, its canonical JSON written, and its parse (kept beside it: from_json
builds a Manifest, so a parse module of its own would import this one and be imported by
it). By concern beside it: manifest_entries.py (shards, chunks, the ChunkTable),
version_ids.py (version ids, version keys, checkpoint names), blob_spans.py (what a
transfer sends of one blob), canonical_read.py (the fast read of to_json's own form),
manifest_checks.py (the field checks every parse shares).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

from coordinator.plan.canonical_read import canonical_document, document_from_pieces
from coordinator.plan.manifest_checks import (
    NOT_JSON,
    SHA256_HEX,
    checked_count,
    checked_fields,
    checked_sha256,
    fail,
    reject_duplicate_keys,
    shown,
)
from coordinator.plan.manifest_entries import ChunkEntry, ChunkTable, ShardEntry
from coordinator.plan.safetensors_header import (
    LENGTH_PREFIX_BYTES,
    CheckpointHeader,
    TensorInfo,
    checked_data_size,
    parse_header,
)
from coordinator.plan.version_ids import chunked_version_id, storage_key, version_id_for
from smoltorrent import defaults
from smoltorrent.errors import CheckpointFormatError, ManifestError

SCHEMA_VERSION = 3  # the newest: chunks
SHARD_SCHEMA_VERSION = 2  # the newest of whole shards
READABLE_SCHEMAS = (1, 2, 3)  # 1: before per-tensor digests; 3: chunks


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
        document = document_from_pieces(pieces)
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


def source_prefix(manifest: Manifest) -> bytes:
    """The first data_start bytes of the source: 8-byte LE header length + header."""
    return struct.pack("<Q", len(manifest.header_bytes)) + manifest.header_bytes


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
        except NOT_JSON as error:
            fail(f"not JSON ({error})")
        fields = checked_fields(document, _manifest_fields(document), "manifest", _OPTIONAL_FIELDS)
        entries = fields.get("chunks", fields.get("shards"))
        kind = "chunk" if "chunks" in fields else "shard"
        if not isinstance(fields["name"], str) or not isinstance(entries, list):
            fail(f"its name or {kind}s have the wrong type")
        blobs = []
        for entry in entries:
            if not isinstance(entry, dict):
                fail(f"a {kind} is not a JSON object")
            what = f"{kind} {len(blobs)}"
            blobs.append(
                (
                    checked_sha256(entry, "blob_sha256", what),
                    checked_count(entry, "blob_size", what),
                )
            )
        return cls(fields["name"], checked_count(fields, "replicas", "manifest", 1), tuple(blobs))


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


def _parse_marks(marks: Any) -> dict[str, Any]:
    """A node's copy's pin and labels: {"seq", "pinned", "labels"}."""
    if not isinstance(marks, dict) or set(marks) != {"seq", "pinned", "labels"}:
        fail(f"marks is {shown(marks)}, not {{seq, pinned, labels}}")
    labels = marks["labels"]
    if not isinstance(marks["pinned"], bool) or not isinstance(labels, list):
        fail(f"marks {shown(marks)} have the wrong types")
    if not all(isinstance(label, str) and LABEL.fullmatch(label) for label in labels):
        fail(f"marks labels {shown(labels)} are not each a label `smoltorrent tag` takes")
    seq = checked_count(marks, "seq", "marks", 1, defaults.MAX_SEQ)
    return {"marks_seq": seq, "pinned": marks["pinned"], "labels": tuple(labels)}


_LATEST_CREATED_AT = 2**40  # unix seconds (year ~36,800): past it, not a time we wrote


def _parse_manifest(held: list[bytes | str]) -> Manifest:
    """Manifest.from_json_taken."""
    data = held.pop()
    document = canonical_document(data)
    try:
        if document is None:  # not to_json's form: any JSON form, checked field by field
            document = json.loads(data, object_pairs_hook=reject_duplicate_keys)
    except NOT_JSON as error:
        fail(f"not JSON ({error})")
    del data
    return _manifest_of(document)


def _manifest_of(document: Any) -> Manifest:
    """The manifest a decoded JSON document holds, every field checked."""
    if not isinstance(document, dict):
        fail("the top level is not a JSON object")
    schema = document.get("schema_version")
    if type(schema) is not int or schema not in READABLE_SCHEMAS:
        newer = isinstance(schema, int) and schema > SCHEMA_VERSION
        raise ManifestError(
            f"unknown manifest schema_version {schema!r}: this smoltorrent reads versions "
            + ", ".join(map(str, READABLE_SCHEMAS))
            + ("; upgrade smoltorrent to read it." if newer else "; the manifest is not ours.")
        )
    fields = checked_fields(document, _manifest_fields(document), "manifest", _OPTIONAL_FIELDS)
    name = fields["name"]
    if not isinstance(name, str) or not name:
        fail(f"name is {name!r}, not a non-empty string")
    try:
        header_bytes = base64.b64decode(fields["header_bytes"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        fail("header_bytes is not base64")
    created_at = fields["created_at"]
    if (
        not isinstance(created_at, int | float)
        or isinstance(created_at, bool)
        or not 0 <= created_at <= _LATEST_CREATED_AT  # also no float could hold it
    ):
        fail(f"created_at is {shown(created_at)}, not unix seconds")
    kind = "chunks" if "chunks" in fields else "shards"
    if not isinstance(fields[kind], list | ChunkTable):
        fail(f"{kind} is not a list")
    chunks = fields.get("chunks", [])
    if not isinstance(chunks, ChunkTable):
        chunks = _chunk_table(_parse_chunk(c, i) for i, c in _consumed(chunks))
    manifest = Manifest(
        name=name,
        version_id=checked_sha256(fields, "version_id", "manifest"),
        source_size=checked_count(fields, "source_size", "manifest", LENGTH_PREFIX_BYTES),
        header_bytes=header_bytes,
        replicas=checked_count(fields, "replicas", "manifest", 1),
        shards=tuple(_parse_shard(shard, schema) for shard in fields.get("shards", ())),
        created_at=float(created_at),
        schema_version=schema,
        chunks=chunks,
        seq=checked_count(fields, "seq", "manifest", 0, defaults.MAX_SEQ) if "seq" in fields else 0,
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
        fail("a chunk's range or size is past 2**63 bytes")


def _consumed(items: list[Any]) -> Iterator[tuple[int, Any]]:
    """enumerate(items), each item dropped from the list once the next is asked for: a
    chunk's JSON object is freed as soon as its entry is built, so the parse never holds
    both for every chunk."""
    for index in range(len(items)):
        item, items[index] = items[index], None
        yield index, item


def _parse_chunk(document: Any, index: int) -> ChunkEntry:
    what = f"chunk {index}"
    fields = checked_fields(document, _CHUNK_FIELDS, f"a {what}")
    return ChunkEntry(
        index=index,
        data_start=checked_count(fields, "data_start", what),
        data_end=checked_count(fields, "data_end", what),
        raw_sha256=checked_sha256(fields, "raw_sha256", what),
        blob_size=checked_count(fields, "blob_size", what, 1),
        blob_sha256=checked_sha256(fields, "blob_sha256", what),
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
        fail(f"its source header does not hold up: {error}")
    covered = 0
    for index, (start, end) in enumerate(manifest.chunks.ranges()):
        if start != covered or end <= start:
            fail(f"chunk {index} covers {start}-{end}; the chunks before it end at {covered}")
        covered = end
    if covered != data_size:
        fail(f"its chunks cover {covered} bytes of a {data_size}-byte data section")


def _parse_shard(document: Any, schema: int) -> ShardEntry:
    # Schema 2 shards may carry per-tensor digests (absent when converted from schema 1).
    given = document.keys() if isinstance(document, dict) and schema >= 2 else set()
    fields = checked_fields(document, _SHARD_FIELDS | ({"tensor_sha256"} & given), "a shard")
    index = checked_count(fields, "index", "a shard")
    what = f"shard {index}"
    tensors = fields["tensors"]
    if not isinstance(tensors, list) or not tensors or not all(isinstance(t, str) for t in tensors):
        fail(f"{what} tensors is {tensors!r}, not a non-empty list of names")
    per_tensor = fields.get("tensor_sha256")
    if "tensor_sha256" in fields and (
        not isinstance(per_tensor, list)
        or len(per_tensor) != len(tensors)
        or not all(isinstance(d, str) and SHA256_HEX.fullmatch(d) for d in per_tensor)
    ):
        fail(f"{what} tensor_sha256 is not one SHA-256 (64 lowercase hex) per tensor")
    return ShardEntry(
        index=index,
        data_start=checked_count(fields, "data_start", what),
        data_end=checked_count(fields, "data_end", what),
        tensors=tuple(tensors),
        blob_size=checked_count(fields, "blob_size", what),
        blob_sha256=checked_sha256(fields, "blob_sha256", what),
        blob_data_offset=checked_count(fields, "blob_data_offset", what, LENGTH_PREFIX_BYTES),
        tensor_sha256=None if per_tensor is None else tuple(per_tensor),
    )


def _check_against_header(manifest: Manifest) -> None:
    """The shards must tile the source's tensors in order, exactly as its header lays them out."""
    try:
        header = _source_header(manifest)
    except CheckpointFormatError as error:
        fail(f"its source header does not hold up: {error}")
    tensors = iter(header.tensors)
    for position, shard in enumerate(manifest.shards):
        what = f"shard {shard.index}"
        if shard.index != position:
            fail(f"{what} is listed at position {position}")
        if shard.blob_size != shard.blob_data_offset + shard.data_end - shard.data_start:
            fail(f"{what} blob_size {shard.blob_size} does not match its header and range")
        members = [next(tensors, None) for _ in shard.tensors]
        if [tensor and tensor.name for tensor in members] != list(shard.tensors):
            fail(f"{what} tensors do not follow the source header's data order")
        if (shard.data_start, shard.data_end) != (members[0].start, members[-1].end):
            fail(f"{what} range {shard.data_start}-{shard.data_end} does not match its tensors")
    if leftover := [tensor.name for tensor in tensors]:
        fail(f"no shard holds the tensors {', '.join(leftover[:3])}")
