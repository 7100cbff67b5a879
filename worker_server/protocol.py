"""The wire protocol as bytes in, values out: framing, request validation, HMAC proofs.

Pure: no sockets, no files. A frame is a fixed 20-byte prefix (magic, protocol
version, flags, reserved, header length, body length), a UTF-8 JSON object
header, then a raw body of the declared length. Anything that does not follow
the protocol raises ProtocolError (or a subclass) with a sentence saying why.

With a cluster key, the handshake binds both nonces and the node id into the
proofs and derives one key per direction; after it, every frame carries a tag
(HMAC-SHA256 over an implicit sequence number, the prefix and the header) right
after its header, and a body not covered by a content digest carries a second
tag after it (flag FLAG_BODY_TAG). A changed, dropped, replayed or reordered
frame fails its tag.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from typing import Any

from smoltorrent import defaults
from smoltorrent.errors import (
    AuthenticationError,
    DigestMismatchError,
    FrameTooLargeError,
    NodeError,
    ProtocolError,
    UnsupportedVersionError,
)

MAGIC = b"SMTR"
PREFIX = struct.Struct(">4sBBHIQ")  # magic, version, flags, reserved, header_len, body_len
PREFIX_BYTES = PREFIX.size

AUTH_HMAC = "hmac-sha256"
AUTH_NONE = "none"
FLAG_BODY_TAG = 0x01  # a tag follows the body: it is not covered by a content digest
KNOWN_FLAGS = FLAG_BODY_TAG
TAG_BYTES = 32  # HMAC-SHA256 output
# Distinct labels so no proof or key can ever be replayed as another one.
CLIENT_PROOF_LABEL = b"smoltorrent/2 client proof"
SERVER_PROOF_LABEL = b"smoltorrent/2 server proof"
CLIENT_TO_SERVER_LABEL = b"smoltorrent/2 client to server"
SERVER_TO_CLIENT_LABEL = b"smoltorrent/2 server to client"
SEQUENCE = struct.Struct(">Q")

ERROR_CODES = frozenset(
    {
        "bad_request",
        "unauthorized",
        "not_found",
        "digest_mismatch",
        "disk_full",
        "disk_error",
        "too_large",
        "busy",
        "unsupported_version",
        "peer_unavailable",
        "internal",
    }
)

HEX_PATTERN = re.compile(r"[0-9a-f]+")
DIGEST_CHARS = 64  # hex digits of a SHA-256
NODE_ID_CHARS = 32  # hex digits of a uuid4
NONCE_CHARS = 2 * defaults.NONCE_BYTES
KEY_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{defaults.MAX_KEY_CHARS - 1}}}")
# A DNS name (at most 253 characters) or an IPv4 address, or a bracketed IPv6 address.
PEER_HOST_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]")
PORT_PATTERN = re.compile(r"[0-9]{1,5}")

# Which request body each operation carries: none, a bounded JSON value, or raw blob bytes.
BODY_NONE, BODY_JSON, BODY_BLOB = "none", "json", "blob"
OPERATIONS: dict[str, tuple[str, frozenset[str]]] = {
    "ping": (BODY_NONE, frozenset()),
    "stat": (BODY_NONE, frozenset()),
    "has": (BODY_JSON, frozenset()),
    # One page: the entries after `after` (in order), at most `limit` of them.
    "list": (BODY_NONE, frozenset({"after", "limit"})),
    "put": (BODY_BLOB, frozenset({"digest", "size"})),
    # A put that the node also passes on, while it arrives, to the `forward` nodes in turn.
    "chain_put": (BODY_BLOB, frozenset({"digest", "size", "forward"})),
    "get": (BODY_NONE, frozenset({"digest", "offset", "length"})),
    "verify": (BODY_NONE, frozenset({"digests"})),
    "delete": (BODY_NONE, frozenset({"digest"})),
    # A push of our copy to `peer`, paced at `rate` bytes/s (0 or absent: unpaced) on the
    # node's one repair bucket, shared with its other repair pushes.
    "replicate": (BODY_NONE, frozenset({"digest", "peer", "rate"})),
    # The same for several blobs to one peer over one connection (a repair session); the
    # answer is a JSON object: digest -> its outcome.
    "replicate_batch": (BODY_NONE, frozenset({"digests", "peer", "rate"})),
    # A manifest over one JSON body's limit travels in parts: each puts the bytes at
    # `offset` of a manifest of `total` bytes, published once the last one arrives.
    "manifest_put": (BODY_JSON, frozenset({"key", "offset", "total"})),
    "manifest_list": (BODY_NONE, frozenset({"after", "limit"})),
    # `length` bytes from `offset` (the whole manifest by default); the answer says its size.
    "manifest_get": (BODY_NONE, frozenset({"key", "offset", "length"})),
    "manifest_delete": (BODY_NONE, frozenset({"key"})),
    "auth": (BODY_NONE, frozenset({"mac", "nonce"})),
    "scrub": (BODY_NONE, frozenset({"start"})),
    "discard": (BODY_NONE, frozenset({"digest"})),
}
# The largest JSON body each operation may carry: a few digests need far less than a manifest.
MAX_REQUEST_BODY_BYTES = {"has": defaults.MAX_HAS_BODY_BYTES}


def encode_frame(header: dict[str, Any], body_len: int = 0, flags: int = 0) -> bytes:
    """The prefix and JSON header of a frame; the caller sends body_len body bytes after it."""
    header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(header_bytes) > defaults.MAX_HEADER_BYTES:
        raise FrameTooLargeError(
            f"frame header is {len(header_bytes)} bytes, over the {defaults.MAX_HEADER_BYTES}"
            " byte limit: send large values in the body instead"
        )
    if not 0 <= body_len <= defaults.MAX_BLOB_BYTES:
        raise FrameTooLargeError(
            f"frame body of {body_len} bytes is outside 0..{defaults.MAX_BLOB_BYTES}"
        )
    prefix = PREFIX.pack(MAGIC, defaults.PROTOCOL_VERSION, flags, 0, len(header_bytes), body_len)
    return prefix + header_bytes


def decode_prefix(data: bytes) -> tuple[int, int]:
    """The 20-byte prefix -> (header_len, body_len), both checked against the protocol limits."""
    header_len, body_len, _ = decode_prefix_flags(data)
    return header_len, body_len


def decode_prefix_flags(data: bytes) -> tuple[int, int, int]:
    """The 20-byte prefix -> (header_len, body_len, flags), checked against the protocol."""
    if len(data) != PREFIX_BYTES:
        raise ProtocolError(f"frame prefix must be {PREFIX_BYTES} bytes, got {len(data)}")
    magic, version, flags, reserved, header_len, body_len = PREFIX.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(
            f"not a smoltorrent frame (magic {magic!r}, expected {MAGIC!r}):"
            " is this port really a smoltorrent node?"
        )
    if version != defaults.PROTOCOL_VERSION:
        raise UnsupportedVersionError(
            f"peer speaks wire protocol version {version}, this side speaks"
            f" {defaults.PROTOCOL_VERSION}: run the same smoltorrent release on both sides"
        )
    if flags & ~KNOWN_FLAGS or reserved != 0:
        raise ProtocolError(f"frame flags {flags} and reserved {reserved} are not in use")
    if header_len == 0 or header_len > defaults.MAX_HEADER_BYTES:
        raise FrameTooLargeError(
            f"frame header length {header_len} is outside 1..{defaults.MAX_HEADER_BYTES} bytes"
        )
    if body_len > defaults.MAX_BLOB_BYTES:
        raise FrameTooLargeError(
            f"frame declares a {body_len} byte body, over the {defaults.MAX_BLOB_BYTES} byte limit"
        )
    return header_len, body_len, flags


def decode_header(data: bytes) -> dict[str, Any]:
    """A frame's header bytes -> the JSON object they hold."""
    value = decode_json(data, what="frame header")
    if not isinstance(value, dict):
        raise ProtocolError(f"frame header must be a JSON object, got {type(value).__name__}")
    return value


def encode_json(value: Any) -> bytes:
    """Compact UTF-8 JSON, the encoding of every JSON body on the wire."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("utf-8")


def decode_json(data: bytes, *, what: str = "JSON body") -> Any:
    """Strict JSON: valid UTF-8, no NaN/Infinity, no duplicate keys."""
    try:
        text = bytes(data).decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as exc:
        raise ProtocolError(
            f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    except RecursionError:
        raise ProtocolError(f"{what} nests JSON values too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError, and the duplicate/constant checks below
        raise ProtocolError(f"{what} is not valid JSON: {exc}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} appears twice")
        result[key] = value
    return result


def validate_request(header: dict[str, Any], body_len: int = 0) -> dict[str, Any]:
    """A request header (and its declared body length) -> its arguments, checked and defaulted."""
    op = header.get("op")
    if not isinstance(op, str) or op not in OPERATIONS:
        known = ", ".join(sorted(OPERATIONS))
        raise ProtocolError(f"unknown operation {op!r}; known operations: {known}")
    body_kind, allowed = OPERATIONS[op]
    unknown = set(header) - allowed - {"op"}
    if unknown:
        raise ProtocolError(f"operation {op!r} takes no field(s) {', '.join(sorted(unknown))}")
    request: dict[str, Any] = {"op": op}
    if "digest" in allowed:
        request["digest"] = validate_digest(header.get("digest"))
    if "key" in allowed:
        request["key"] = validate_key(header.get("key"))
    if op in ("put", "chain_put"):
        request["size"] = validate_length(header.get("size"), "size")
    if op == "chain_put":
        request["forward"] = validate_forward(header.get("forward"))
    if op in ("list", "manifest_list"):
        after = header.get("after")
        if after is not None:
            after = validate_digest(after) if op == "list" else validate_key(after)
        request["after"] = after
        limit = header.get("limit", defaults.LIST_PAGE_ENTRIES)
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise ProtocolError(f"limit must be an integer, got {_shown(limit)}")
        if not 1 <= limit <= defaults.LIST_PAGE_ENTRIES:
            raise ProtocolError(f"limit {limit} is outside 1..{defaults.LIST_PAGE_ENTRIES}")
        request["limit"] = limit
    if op == "manifest_put":
        request["offset"] = validate_length(header.get("offset", 0), "offset")
        total = header.get("total")
        request["total"] = None if total is None else validate_length(total, "total")
        if request["total"] is not None and request["offset"] + body_len > request["total"]:
            raise ProtocolError(
                f"manifest part at {request['offset']} of {body_len} bytes runs past its"
                f" total of {request['total']}"
            )
        if request["total"] is None and request["offset"]:
            raise ProtocolError("a manifest part past offset 0 must say the manifest's total")
        if (request["total"] or 0) > defaults.MAX_MANIFEST_BYTES:
            raise FrameTooLargeError(
                f"a manifest of {request['total']} bytes is over the"
                f" {defaults.MAX_MANIFEST_BYTES} byte limit"
            )
    if op == "manifest_get":
        request["offset"] = validate_length(header.get("offset", 0), "offset")
        length = header.get("length")
        request["length"] = None if length is None else validate_length(length, "length")
    if op == "get":
        request["offset"] = validate_length(header.get("offset", 0), "offset")
        length = header.get("length")
        request["length"] = None if length is None else validate_length(length, "length")
    if op == "verify":
        digests = header.get("digests")
        request["digests"] = None if digests is None else validate_digest_list(digests)
    if op == "scrub":
        start = header.get("start", True)
        if not isinstance(start, bool):
            raise ProtocolError(f"scrub's start must be true or false, got {start!r}")
        request["start"] = start
    if op in ("replicate", "replicate_batch"):
        request["peer"] = validate_peer(header.get("peer"))
        request["rate"] = validate_rate(header.get("rate", 0))
    if op == "replicate_batch":
        digests = validate_digest_list(header.get("digests"))
        if not 1 <= len(digests) <= defaults.REPAIR_BATCH_BLOBS:
            raise ProtocolError(
                f"replicate_batch names {len(digests)} blobs; one session carries"
                f" 1..{defaults.REPAIR_BATCH_BLOBS}"
            )
        if len(set(digests)) != len(digests):
            raise ProtocolError("replicate_batch names a blob twice")
        request["digests"] = digests
    if op == "auth":
        request["mac"] = _validate_hex(header.get("mac"), DIGEST_CHARS, "mac")
        request["nonce"] = _validate_hex(header.get("nonce"), NONCE_CHARS, "nonce")
    _validate_body_len(op, body_kind, body_len, request)
    return request


def _validate_body_len(op: str, body_kind: str, body_len: int, request: dict[str, Any]) -> None:
    if body_kind == BODY_NONE and body_len != 0:
        raise ProtocolError(f"operation {op!r} takes no body, but the frame declares {body_len}")
    limit = MAX_REQUEST_BODY_BYTES.get(op, defaults.MAX_JSON_BODY_BYTES)
    if body_kind == BODY_JSON and body_len > limit:
        raise FrameTooLargeError(
            f"{op!r} body of {body_len} bytes is over its {limit} byte limit: send fewer"
            " items per request"
        )
    if body_kind == BODY_BLOB and body_len != request["size"]:
        raise ProtocolError(
            f"put declares size {request['size']} but a body of {body_len} bytes; they must match"
        )


def validate_digest(value: Any) -> str:
    """A SHA-256 digest: exactly 64 lowercase hex characters, so it is safe as a file name."""
    return _validate_hex(value, DIGEST_CHARS, "digest")


def validate_digest_list(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ProtocolError(f"digests must be a JSON list, got {type(value).__name__}")
    return [validate_digest(item) for item in value]


def validate_key(value: Any) -> str:
    """A manifest key: one safe file name component (no '/', no leading '.')."""
    if not isinstance(value, str) or not KEY_PATTERN.fullmatch(value):
        raise ProtocolError(
            f"manifest key {_shown(value)} is invalid: use 1-{defaults.MAX_KEY_CHARS} characters"
            " from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return value


def validate_length(value: Any, name: str) -> int:
    """A byte count or offset: a JSON integer in 0..MAX_BLOB_BYTES."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer, got {_shown(value)}")
    if not 0 <= value <= defaults.MAX_BLOB_BYTES:
        raise ProtocolError(f"{name} {value} is outside 0..{defaults.MAX_BLOB_BYTES}")
    return value


def validate_rate(value: Any) -> int:
    """A rate in bytes/s: a JSON integer in 0..MAX_BLOB_BYTES (0: no limit)."""
    return validate_length(value, "rate")


def validate_peer(value: Any) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    if isinstance(value, str):
        host, sep, port_text = value.rpartition(":")
        if sep and PEER_HOST_PATTERN.fullmatch(host) and PORT_PATTERN.fullmatch(port_text):
            port = int(port_text)
            if 0 < port < 65536:
                return host.strip("[]"), port
    raise ProtocolError(f"peer {_shown(value)} is not a 'host:port' address")


def validate_forward(value: Any) -> list[tuple[str, int]]:
    """A chain_put's forward list: distinct 'host:port' peers, at most MAX_CHAIN_FORWARD, so
    one request can make a node open only a few bounded connections."""
    if not isinstance(value, list):
        raise ProtocolError(f"forward must be a JSON list of 'host:port', got {_shown(value)}")
    if len(value) > defaults.MAX_CHAIN_FORWARD:
        raise ProtocolError(
            f"forward names {len(value)} nodes; a chain passes a blob on to at most"
            f" {defaults.MAX_CHAIN_FORWARD}"
        )
    peers = [validate_peer(item) for item in value]
    if len(set(peers)) != len(peers):
        raise ProtocolError(f"forward names a node twice: {_shown(value)}")
    return peers


def peer_text(host: str, port: int) -> str:
    """(host, port) -> 'host:port' or '[v6]:port', as validate_peer reads it back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# What a chain_put reports for each node of its chain (itself, then each forward node in
# order): the node's id when known, and what became of its copy.
CHAIN_STORED, CHAIN_EXISTS, CHAIN_FAILED = "stored", "exists", "failed"
CHAIN_STATUSES = frozenset({CHAIN_STORED, CHAIN_EXISTS, CHAIN_FAILED})


def chain_entry(
    status: str, node_id: str | None = None, error: str | None = None, message: str = ""
) -> dict[str, Any]:
    """One node's fate in a chain; a failed one carries an error code and a short sentence."""
    entry: dict[str, Any] = {"status": status, "node_id": node_id}
    if status == CHAIN_FAILED:
        entry["error"] = error if error in ERROR_CODES else "internal"
        entry["message"] = message[: defaults.MAX_CHAIN_MESSAGE_CHARS]
    return entry


def validate_chain_entry(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or value.get("status") not in CHAIN_STATUSES:
        raise ProtocolError(f"chain report entry {_shown(value)} has no known status")
    node_id = value.get("node_id")
    if node_id is not None:
        node_id = _validate_hex(node_id, NODE_ID_CHARS, "node_id")
    message = value.get("message", "")
    if not isinstance(message, str):
        raise ProtocolError(f"chain report message {_shown(message)} is not a string")
    return chain_entry(value["status"], node_id, value.get("error"), message)


def validate_chain_report(header: dict[str, Any], forwarded: int) -> dict[str, Any]:
    """A chain_put's final answer -> {"self": entry, "forward": [entry per forward node]},
    checked: exactly one entry for each of the `forwarded` nodes it was asked to pass on to."""
    forward = header.get("forward")
    if header.get("status") != "done" or not isinstance(forward, list):
        raise ProtocolError(f"a chain_put ended with {_shown(header)}, not its chain report")
    if len(forward) != forwarded:
        raise ProtocolError(
            f"a chain report names {len(forward)} forward nodes where {forwarded} were asked"
        )
    return {
        "self": validate_chain_entry(header.get("self")),
        "forward": [validate_chain_entry(item) for item in forward],
    }


def validate_hello(header: dict[str, Any]) -> dict[str, Any]:
    """The server's first frame, as the client sees it."""
    if header.get("op") != "hello":
        raise ProtocolError(f"expected a hello frame from the node, got {_shown(header)}")
    if header.get("protocol") != defaults.PROTOCOL_VERSION:
        raise UnsupportedVersionError(
            f"node speaks wire protocol {_shown(header.get('protocol'))}, this side speaks"
            f" {defaults.PROTOCOL_VERSION}: run the same smoltorrent release on both sides"
        )
    node_id = _validate_hex(header.get("node_id"), NODE_ID_CHARS, "node_id")
    auth = header.get("auth")
    if auth not in (AUTH_HMAC, AUTH_NONE):
        raise ProtocolError(f"node offers unknown authentication {_shown(auth)}")
    nonce = _validate_hex(header.get("nonce"), NONCE_CHARS, "nonce")
    return {"node_id": node_id, "auth": auth, "nonce": bytes.fromhex(nonce)}


def error_header(code: str, message: str) -> dict[str, Any]:
    """An error frame's header; code is one of ERROR_CODES, message a sentence for a human."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    return {"ok": False, "error": code, "message": message}


def check_response(header: dict[str, Any], peer: str) -> dict[str, Any]:
    """A response header -> itself if ok, else the error it carries, raised with the peer named."""
    ok = header.get("ok")
    if ok is True:
        return header
    if ok is not False:
        raise ProtocolError(f"node {peer} sent a response without a boolean 'ok': {_shown(header)}")
    code, message = header.get("error"), header.get("message")
    if code not in ERROR_CODES or not isinstance(message, str):
        raise ProtocolError(f"node {peer} sent a malformed error frame: {_shown(header)}")
    text = f"node {peer}: {message}"
    if code == "digest_mismatch":
        raise DigestMismatchError(text)
    if code == "unauthorized":
        raise AuthenticationError(text)
    raise NodeError(code, text)


def _transcript(server_nonce: bytes, client_nonce: bytes, node_id: str) -> bytes:
    """What both proofs and both session keys are bound to: fixed-size fields, no ambiguity."""
    return server_nonce + client_nonce + node_id.encode("ascii")


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes, node_id: str) -> str:
    """What the client sends to prove it holds the cluster key, for this one handshake."""
    message = CLIENT_PROOF_LABEL + _transcript(server_nonce, client_nonce, node_id)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes, node_id: str) -> str:
    """What the server answers to prove it holds the cluster key too."""
    message = SERVER_PROOF_LABEL + _transcript(server_nonce, client_nonce, node_id)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def session_keys(
    key: bytes, server_nonce: bytes, client_nonce: bytes, node_id: str
) -> tuple[bytes, bytes]:
    """(client-to-server, server-to-client) frame keys: fresh for every connection."""
    transcript = _transcript(server_nonce, client_nonce, node_id)
    return (
        hmac.new(key, CLIENT_TO_SERVER_LABEL + transcript, hashlib.sha256).digest(),
        hmac.new(key, SERVER_TO_CLIENT_LABEL + transcript, hashlib.sha256).digest(),
    )


def header_tag(key: bytes, sequence: int, frame_head: bytes) -> bytes:
    """The tag after a frame's header: its sequence number, prefix and header under key."""
    return hmac.new(key, SEQUENCE.pack(sequence) + frame_head, hashlib.sha256).digest()


def body_mac(key: bytes, head_tag: bytes) -> hmac.HMAC:
    """A running MAC of a body, chained to its frame's header tag; fed as the body streams."""
    return hmac.new(key, head_tag, hashlib.sha256)


def tags_match(expected: bytes, received: bytes) -> bool:
    return hmac.compare_digest(expected, received)


def proofs_match(expected: str, received: Any) -> bool:
    """Constant-time comparison, so timing leaks nothing about the expected proof."""
    if not isinstance(received, str) or not received.isascii():
        return False
    return hmac.compare_digest(expected.encode("ascii"), received.encode("ascii"))


def _validate_hex(value: Any, chars: int, name: str) -> str:
    if not isinstance(value, str) or len(value) != chars or not HEX_PATTERN.fullmatch(value):
        raise ProtocolError(f"{name} {_shown(value)} is not exactly {chars} lowercase hex digits")
    return value


def _shown(value: Any) -> str:
    """A peer's value, shortened, for an error message (hostile inputs can be huge)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
