"""Reading a manifest's JSON written as Manifest.to_json writes it (every manifest
smoltorrent stores) without decoding its chunk list as JSON: the chunks go straight into
a ChunkTable, whole or a piece of the text at a time, and the other fields are decoded in
place. What is not in that form is left to the whole parse (coordinator/plan/manifest.py),
which names what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from coordinator.plan.manifest_checks import NOT_JSON, reject_duplicate_keys
from coordinator.plan.manifest_entries import CHUNK_TEXT, DIGEST_BYTES, ChunkColumns, ChunkTable
from smoltorrent.errors import ManifestError

_CHUNKS_OPENING = '{"chunks":['  # to_json's first key, sorted, is a chunked manifest's list


def canonical_document(data: bytes | str) -> dict[str, Any] | None:
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
    except (*NOT_JSON, ManifestError):
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
        decoder = json.JSONDecoder(object_pairs_hook=reject_duplicate_keys)
        _scanner.append(decoder.scan_once)
    return _scanner[0]


# The most text one chunk's object (with the comma or bracket after it) takes in to_json's
# form: a piece of the text that ends in less than this may cut one short.
_CHUNK_TEXT_MOST = (
    len('{"blob_sha256":"","blob_size":,"data_end":,"data_start":,"raw_sha256":""}')
    + 4 * DIGEST_BYTES
    + 3 * 18
    + 1
)


def document_from_pieces(pieces: Iterator[str]) -> dict[str, Any] | None:
    """canonical_document of the text the pieces make, read a piece at a time."""
    buffer, position = "", len(_CHUNKS_OPENING)
    while len(buffer) <= position:
        more = next(pieces, None)
        if more is None:
            return None
        buffer += more
    if not buffer.startswith(_CHUNKS_OPENING):
        return None
    columns = ChunkColumns()
    closed = buffer[position] == "]"
    position += closed
    while not closed:
        found = CHUNK_TEXT.match(buffer, position)
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
    except (*NOT_JSON, ManifestError):
        return None
