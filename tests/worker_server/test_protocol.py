"""The wire protocol on bytes alone: framing, validation, error frames, HMAC proofs."""

from __future__ import annotations

import json
import pickle
import struct

import pytest

from smoltorrent import defaults
from smoltorrent.errors import (
    AuthenticationError,
    DigestMismatchError,
    FrameTooLargeError,
    NodeError,
    ProtocolError,
    UnsupportedVersionError,
)
from worker_server import protocol

DIGEST = "ab" * 32


def prefix(header_len: int = 2, body_len: int = 0, **fields: int | bytes) -> bytes:
    values = {"magic": b"SMTR", "version": defaults.PROTOCOL_VERSION, "flags": 0, "reserved": 0}
    values.update(fields)
    return protocol.PREFIX.pack(
        values["magic"], values["version"], values["flags"], values["reserved"],
        header_len, body_len,
    )  # fmt: skip


def test_frame_round_trip() -> None:
    header = {"op": "put", "digest": DIGEST, "size": 5, "name": "ünïcode"}
    frame = protocol.encode_frame(header, body_len=5)
    assert len(frame) >= protocol.PREFIX_BYTES == 20
    header_len, body_len = protocol.decode_prefix(frame[:20])
    assert (header_len, body_len) == (len(frame) - 20, 5)
    assert protocol.decode_header(frame[20:]) == header


def test_largest_body_round_trips() -> None:
    frame = protocol.encode_frame({"op": "ping"}, defaults.MAX_BLOB_BYTES)
    assert protocol.decode_prefix(frame[:20])[1] == defaults.MAX_BLOB_BYTES


def test_wrong_magic_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="not a smoltorrent frame"):
        protocol.decode_prefix(prefix(magic=b"HTTP"))


def test_http_request_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="magic"):
        protocol.decode_prefix(b"GET / HTTP/1.1\r\nHost: x"[:20])


def test_pickle_bytes_are_rejected() -> None:
    payload = pickle.dumps({"op": "ping"})
    with pytest.raises(ProtocolError):
        protocol.decode_prefix(payload[:20])
    with pytest.raises(ProtocolError, match="UTF-8|JSON"):
        protocol.decode_header(payload)


def test_wrong_version_is_rejected() -> None:
    with pytest.raises(UnsupportedVersionError, match="same smoltorrent release"):
        protocol.decode_prefix(prefix(version=defaults.PROTOCOL_VERSION + 1))


def test_unknown_flags_are_rejected() -> None:
    assert protocol.decode_prefix_flags(prefix(flags=protocol.FLAG_BODY_TAG))[2] == 1
    with pytest.raises(ProtocolError, match="flags"):
        protocol.decode_prefix(prefix(flags=2))


def test_short_prefix_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="20 bytes"):
        protocol.decode_prefix(prefix()[:19])


@pytest.mark.parametrize("body_len", [2**63, 2**64 - 1, defaults.MAX_BLOB_BYTES + 1])
def test_huge_body_length_is_rejected(body_len: int) -> None:
    with pytest.raises(FrameTooLargeError, match="body"):
        protocol.decode_prefix(prefix(body_len=body_len))


@pytest.mark.parametrize("header_len", [0, defaults.MAX_HEADER_BYTES + 1, 2**32 - 1])
def test_header_length_out_of_bounds_is_rejected(header_len: int) -> None:
    with pytest.raises(FrameTooLargeError, match="header length"):
        protocol.decode_prefix(prefix(header_len=header_len))


def test_encoding_a_too_big_header_is_refused() -> None:
    with pytest.raises(FrameTooLargeError, match="header"):
        protocol.encode_frame({"op": "ping", "pad": "x" * defaults.MAX_HEADER_BYTES})


def test_encoding_a_negative_or_huge_body_is_refused() -> None:
    for body_len in (-1, 2**63):
        with pytest.raises(FrameTooLargeError):
            protocol.encode_frame({"op": "ping"}, body_len)


@pytest.mark.parametrize("text", [b"[1, 2]", b'"op"', b"42", b"null", b"true"])
def test_header_that_is_not_an_object_is_rejected(text: bytes) -> None:
    with pytest.raises(ProtocolError, match="JSON object"):
        protocol.decode_header(text)


@pytest.mark.parametrize(
    "text", [b"\xff\xfe{}", b'{"op": "\xc3\x28"}', b"\x80\x04\x95"], ids=["bom", "bad2", "pickle"]
)
def test_invalid_utf8_is_rejected(text: bytes) -> None:
    with pytest.raises(ProtocolError, match="UTF-8"):
        protocol.decode_header(text)


@pytest.mark.parametrize(
    "text",
    [b"{", b"{'op': 'ping'}", b'{"size": NaN}', b'{"size": Infinity}', b'{"op":"a","op":"b"}'],
)
def test_malformed_json_is_rejected(text: bytes) -> None:
    with pytest.raises(ProtocolError, match="not valid JSON"):
        protocol.decode_header(text)


def test_deeply_nested_json_is_rejected() -> None:
    with pytest.raises(ProtocolError):
        protocol.decode_header(b"[" * 60000 + b"]" * 60000)


def test_valid_requests_are_normalised() -> None:
    assert protocol.validate_request({"op": "ping"}) == {"op": "ping"}
    get = protocol.validate_request({"op": "get", "digest": DIGEST})
    assert get == {"op": "get", "digest": DIGEST, "offset": 0, "length": None}
    put = protocol.validate_request({"op": "put", "digest": DIGEST, "size": 10}, body_len=10)
    assert put["size"] == 10
    replicate = protocol.validate_request({"op": "replicate", "digest": DIGEST, "peer": "pi4:7411"})
    assert replicate["peer"] == ("pi4", 7411)
    v6 = protocol.validate_request({"op": "replicate", "digest": DIGEST, "peer": "[::1]:7411"})
    assert v6["peer"] == ("::1", 7411)
    assert protocol.validate_request({"op": "verify", "digests": None})["digests"] is None


@pytest.mark.parametrize(
    "header",
    [
        {},
        {"op": "shell"},
        {"op": ["ping"]},
        {"op": "ping", "extra": 1},
        {"op": "get", "digest": DIGEST.upper()},
        {"op": "get", "digest": DIGEST[:-1]},
        {"op": "get", "digest": DIGEST + "0"},
        {"op": "get", "digest": "../" + DIGEST[3:]},
        {"op": "get", "digest": "/etc/passwd"},
        {"op": "get", "digest": 12},
        {"op": "get", "digest": DIGEST, "offset": -1},
        {"op": "get", "digest": DIGEST, "offset": 1.5},
        {"op": "get", "digest": DIGEST, "offset": True},
        {"op": "get", "digest": DIGEST, "length": 2**63},
        {"op": "put", "digest": DIGEST, "size": "10"},
        {"op": "delete", "digest": DIGEST + "\n"},
        {"op": "verify", "digests": [DIGEST, "nope"]},
        {"op": "verify", "digests": DIGEST},
        {"op": "replicate", "digest": DIGEST, "peer": "pi4"},
        {"op": "replicate", "digest": DIGEST, "peer": "pi4:0"},
        {"op": "replicate", "digest": DIGEST, "peer": "pi4:99999"},
        {"op": "replicate", "digest": DIGEST, "peer": "pi4:７４１１"},
        {"op": "replicate", "digest": DIGEST, "peer": "a b:7411"},
        {"op": "auth", "mac": "00", "nonce": "11"},
    ],
)
def test_invalid_requests_are_rejected(header: dict) -> None:
    with pytest.raises(ProtocolError):
        protocol.validate_request(header)


@pytest.mark.parametrize(
    "key",
    ["../x", "/etc/passwd", "..", ".", ".hidden", "a/b", "a\\b", "", "x" * 129, "a\x00b", "é", 5],
)
def test_unsafe_manifest_keys_are_rejected(key: object) -> None:
    with pytest.raises(ProtocolError, match="manifest key"):
        protocol.validate_request({"op": "manifest_get", "key": key})


@pytest.mark.parametrize("key", ["run1", "grpo.run1.step_100-v2", "A" * 128, "0"])
def test_safe_manifest_keys_are_accepted(key: str) -> None:
    assert protocol.validate_key(key) == key


def test_body_length_must_fit_the_operation() -> None:
    with pytest.raises(ProtocolError, match="takes no body"):
        protocol.validate_request({"op": "ping"}, body_len=1)
    with pytest.raises(FrameTooLargeError):
        protocol.validate_request({"op": "has"}, body_len=defaults.MAX_JSON_BODY_BYTES + 1)
    with pytest.raises(ProtocolError, match="must match"):
        protocol.validate_request({"op": "put", "digest": DIGEST, "size": 10}, body_len=11)


def test_error_frames_carry_code_and_sentence() -> None:
    header = protocol.error_header("not_found", "this node holds no blob x.")
    assert header == {"ok": False, "error": "not_found", "message": "this node holds no blob x."}
    frame = protocol.encode_frame(header)
    assert protocol.decode_header(frame[20:]) == header
    with pytest.raises(ValueError):
        protocol.error_header("oops", "unknown codes are a bug")


def test_error_frames_become_typed_errors() -> None:
    with pytest.raises(NodeError) as raised:
        protocol.check_response(protocol.error_header("disk_full", "full."), "pi4:7411")
    assert raised.value.code == "disk_full"
    assert "pi4:7411" in str(raised.value)
    with pytest.raises(DigestMismatchError):
        protocol.check_response(protocol.error_header("digest_mismatch", "bad."), "pi4:7411")
    with pytest.raises(AuthenticationError):
        protocol.check_response(protocol.error_header("unauthorized", "key."), "pi4:7411")
    assert protocol.check_response({"ok": True, "x": 1}, "pi4:7411") == {"ok": True, "x": 1}


@pytest.mark.parametrize(
    "header", [{}, {"ok": "yes"}, {"ok": False}, {"ok": False, "error": "nope", "message": "m"}]
)
def test_malformed_responses_are_rejected(header: dict) -> None:
    with pytest.raises(ProtocolError):
        protocol.check_response(header, "pi4:7411")


def test_hello_is_validated() -> None:
    hello = {
        "op": "hello",
        "protocol": defaults.PROTOCOL_VERSION,
        "node_id": "0" * 32,
        "auth": "hmac-sha256",
        "nonce": "ab" * defaults.NONCE_BYTES,
    }
    assert protocol.validate_hello(hello)["nonce"] == bytes.fromhex(hello["nonce"])
    with pytest.raises(UnsupportedVersionError):
        protocol.validate_hello({**hello, "protocol": 99})
    with pytest.raises(ProtocolError):
        protocol.validate_hello({**hello, "auth": "plaintext"})


def test_hmac_proofs_are_mutual_and_distinct() -> None:
    key, ns, nc = b"key", b"\x01" * defaults.NONCE_BYTES, b"\x02" * defaults.NONCE_BYTES
    node = "ab" * 16
    client = protocol.client_proof(key, ns, nc, node)
    server = protocol.server_proof(key, ns, nc, node)
    assert client != server  # a server cannot be fooled by echoing the client's own proof
    assert protocol.proofs_match(client, protocol.client_proof(key, ns, nc, node))
    assert not protocol.proofs_match(client, protocol.client_proof(b"other", ns, nc, node))
    # Bound to both nonces and the node: a proof for another connection or node is worthless.
    assert not protocol.proofs_match(client, protocol.client_proof(key, ns, ns, node))
    assert not protocol.proofs_match(client, protocol.client_proof(key, nc, nc, node))
    assert not protocol.proofs_match(client, protocol.client_proof(key, ns, nc, "cd" * 16))
    assert not protocol.proofs_match(client, None)
    assert not protocol.proofs_match(client, "é" * 64)


def test_session_keys_differ_per_direction_and_connection() -> None:
    key, ns, nc, node = b"key", b"\x01" * 32, b"\x02" * 32, "ab" * 16
    to_server, to_client = protocol.session_keys(key, ns, nc, node)
    assert to_server != to_client
    assert protocol.session_keys(key, ns, b"\x03" * 32, node)[0] != to_server
    assert to_server not in {bytes.fromhex(protocol.client_proof(key, ns, nc, node))}


def test_frame_tags_bind_the_sequence_number_and_every_header_byte() -> None:
    key = b"k" * 32
    head = protocol.encode_frame({"op": "delete", "digest": DIGEST})
    tag = protocol.header_tag(key, 0, head)
    assert protocol.tags_match(tag, protocol.header_tag(key, 0, head))
    assert not protocol.tags_match(tag, protocol.header_tag(key, 1, head))  # replayed later
    flipped = head[:-3] + bytes([head[-3] ^ 1]) + head[-2:]
    assert not protocol.tags_match(tag, protocol.header_tag(key, 0, flipped))


def test_json_bodies_round_trip() -> None:
    value = {DIGEST: 12, "list": [1, 2]}
    assert protocol.decode_json(protocol.encode_json(value)) == value
    assert json.loads(protocol.encode_json(value)) == value
    with pytest.raises(ValueError):
        protocol.encode_json(float("nan"))


def test_struct_layout_is_big_endian_and_fixed() -> None:
    frame = protocol.encode_frame({"op": "ping"}, body_len=258)
    assert frame[:4] == b"SMTR"
    assert struct.unpack(">Q", frame[12:20]) == (258,)


def test_chain_put_forward_list_is_validated() -> None:
    ok = protocol.validate_request(
        {"op": "chain_put", "digest": DIGEST, "size": 4, "forward": ["pi2:7411", "[::1]:7412"]},
        body_len=4,
    )
    assert ok["forward"] == [("pi2", 7411), ("::1", 7412)]
    assert protocol.peer_text("::1", 7412) == "[::1]:7412"
    for forward in (
        "pi2:7411",
        ["pi2"],
        ["pi2:7411", "pi2:7411"],
        [f"pi{i}:7411" for i in range(defaults.MAX_CHAIN_FORWARD + 1)],
        [{"host": "pi2"}],
    ):
        with pytest.raises(ProtocolError):
            protocol.validate_request(
                {"op": "chain_put", "digest": DIGEST, "size": 4, "forward": forward}, body_len=4
            )


def test_chain_report_is_checked_entry_by_entry() -> None:
    entry = protocol.chain_entry("failed", None, "no_such_code", "x" * 10_000)
    assert entry["error"] == "internal"
    assert len(entry["message"]) == defaults.MAX_CHAIN_MESSAGE_CHARS
    good = {"status": "done", "self": {"status": "stored", "node_id": None}, "forward": []}
    assert protocol.validate_chain_report(good, 0)["self"]["status"] == "stored"
    for bad, forwarded in (
        (good, 1),  # one entry per forward node, no fewer
        ({**good, "status": "stored"}, 0),
        ({**good, "self": {"status": "maybe"}}, 0),
        ({**good, "self": {"status": "stored", "node_id": "../etc"}}, 0),
    ):
        with pytest.raises(ProtocolError):
            protocol.validate_chain_report(bad, forwarded)


def test_a_manifest_put_over_the_manifest_limit_is_refused() -> None:
    """Parts of a manifest declared past MAX_MANIFEST_BYTES would pile up in the node's tmp/
    until the last one; refused at the first part."""
    total = defaults.MAX_MANIFEST_BYTES + 1
    put = {"op": "manifest_put", "key": "k", "offset": 0, "total": total}
    with pytest.raises(FrameTooLargeError, match="manifest"):
        protocol.validate_request(put, body_len=1024)
    assert protocol.validate_request({**put, "total": total - 1}, body_len=1024)["total"]
