"""A selection of tensors: which byte ranges of which shards (or which chunks) a partial
load reads, and the standalone .safetensors file they make.

Pure, like the rest of plan/: it works from the manifest alone. The selected tensors
keep the source's data order and are packed one after another in the output (the
source's own `__metadata__` is kept), so tensors that are neighbours in a shard are
neighbours in the output too and come in one ranged read.
"""

from __future__ import annotations

import fnmatch
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.plan.manifest import Manifest
from coordinator.plan.safetensors_header import (
    LENGTH_PREFIX_BYTES,
    METADATA_KEY,
    TensorInfo,
    parse_header,
)
from smoltorrent.errors import NotFoundError

_HEADER_ALIGNMENT = 8  # bytes, as safetensors writers pad their headers
_SHOWN_NAMES = 5  # tensor names an unmatched pattern's error lists, as examples


@dataclass(frozen=True)
class Piece:
    """One selected tensor: where it is in its blob, where it goes in the output."""

    name: str
    blob_offset: int  # in the shard's blob (its own header first)
    length: int
    out_offset: int  # in the output file
    sha256: str | None  # of its bytes; None in a schema 1 manifest


@dataclass(frozen=True)
class Read:
    """What one shard contributes: pieces adjacent in the blob, in order."""

    shard: int  # or chunk, in a chunked manifest
    pieces: tuple[Piece, ...]

    @property
    def offset(self) -> int:
        return self.pieces[0].blob_offset

    @property
    def length(self) -> int:
        return self.pieces[-1].blob_offset + self.pieces[-1].length - self.offset


@dataclass(frozen=True)
class Selection:
    prefix: bytes  # the output's 8-byte length and header
    size: int  # of the whole output file
    reads: tuple[Read, ...]  # ranged reads of shards, or the chunks holding a selected byte
    # shards fetched whole: their manifest (schema 1) has no tensor digests. Never a chunk:
    # a chunk is read whole by design and checked against its own digests.
    whole_shards: frozenset[int]

    @property
    def names(self) -> list[str]:
        return [p.name for read in self.reads for p in read.pieces]

    @property
    def data_bytes(self) -> int:
        return sum(p.length for read in self.reads for p in read.pieces)


def pick(names: Sequence[str], patterns: Sequence[str]) -> tuple[set[str], list[str]]:
    """The names that `patterns` select, and the patterns that select none. A pattern that
    is one of the names selects just that one (even "w[0]", which fnmatch reads as "w0");
    any other is a glob (fnmatch, case-sensitive)."""
    exact = set(names).intersection(patterns)

    def hit(name: str, pattern: str) -> bool:
        return name == pattern if pattern in exact else fnmatch.fnmatchcase(name, pattern)

    chosen = {n for n in names if any(hit(n, p) for p in patterns)}
    return chosen, [p for p in patterns if not any(hit(n, p) for n in names)]


def select(manifest: Manifest, patterns: Sequence[str]) -> Selection:
    """The tensors of `manifest` that `patterns` pick. NotFoundError names a pattern that
    matches nothing: a typo would otherwise load a state dict silently missing what it
    meant to load."""
    header = parse_header(
        struct.pack("<Q", len(manifest.header_bytes)),
        manifest.header_bytes,
        manifest.source_size,
        source=f"manifest of {manifest.name}",
    )
    names = [t.name for t in header.tensors]
    chosen, missing = pick(names, patterns)
    if missing:
        shown = ", ".join(names[:_SHOWN_NAMES]) + (", ..." if len(names) > _SHOWN_NAMES else "")
        raise NotFoundError(
            f"no tensor of {manifest.name} matches {missing[0]!r} (its tensors: {shown}); "
            f"`smoltorrent show {manifest.name} --tensors` lists them all."
        )
    by_name = {t.name: t for t in header.tensors}
    picked = [t for t in header.tensors if t.name in chosen]
    prefix = _header(picked, header.metadata)
    out = len(prefix)
    if manifest.chunked:
        reads = _chunk_reads(manifest, picked, len(prefix))
        return Selection(
            prefix=prefix,
            size=len(prefix) + sum(t.size for t in picked),
            reads=reads,
            whole_shards=frozenset(),
        )
    reads: list[Read] = []
    whole: set[int] = set()
    for shard in manifest.shards:
        run: list[Piece] = []
        previous_end = None
        for position, name in enumerate(shard.tensors):
            if name not in chosen:
                continue
            tensor = by_name[name]
            piece = Piece(
                name=name,
                blob_offset=shard.blob_data_offset + tensor.start - shard.data_start,
                length=tensor.size,
                out_offset=out,
                sha256=None if shard.tensor_sha256 is None else shard.tensor_sha256[position],
            )
            out += tensor.size
            # A whole-shard read carries every selected piece of the shard; a ranged one
            # only a run of neighbours (a gap would move bytes nobody asked for).
            if run and shard.tensor_sha256 is not None and previous_end != piece.blob_offset:
                reads.append(Read(shard.index, tuple(run)))
                run = []
            run.append(piece)
            previous_end = piece.blob_offset + piece.length
        if run:
            reads.append(Read(shard.index, tuple(run)))
            if shard.tensor_sha256 is None:
                whole.add(shard.index)
    return Selection(prefix=prefix, size=out, reads=tuple(reads), whole_shards=frozenset(whole))


def _chunk_reads(manifest: Manifest, picked: Sequence[TensorInfo], out: int) -> tuple[Read, ...]:
    """One read per chunk holding a byte of a picked tensor: an encoded chunk is read and
    decoded whole (its digests cover only the whole), and only the picked ranges of its
    raw bytes are written out. A piece's blob_offset counts from the chunk's first raw
    byte; a tensor cut over several chunks is a piece in each."""
    pieces: dict[int, list[Piece]] = {}
    chunks = manifest.chunks
    at = 0  # the first chunk that may hold the next tensor (both in data order)
    for tensor in picked:
        if not tensor.size:
            continue  # no bytes: only its header entry
        while at < len(chunks) and chunks[at].data_end <= tensor.start:
            at += 1
        index = at
        while index < len(chunks) and chunks[index].data_start < tensor.end:
            chunk = chunks[index]
            lo, hi = max(tensor.start, chunk.data_start), min(tensor.end, chunk.data_end)
            at_out = out + lo - tensor.start
            piece = Piece(tensor.name, lo - chunk.data_start, hi - lo, at_out, None)
            pieces.setdefault(chunk.index, []).append(piece)
            index += 1
        out += tensor.size
    return tuple(Read(index, tuple(run)) for index, run in sorted(pieces.items()))


def _header(tensors: Sequence[TensorInfo], metadata: dict[str, str] | None) -> bytes:
    entries: dict = {METADATA_KEY: metadata} if metadata else {}
    offset = 0
    for tensor in tensors:
        entries[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.size],
        }
        offset += tensor.size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-(LENGTH_PREFIX_BYTES + len(raw)) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw
