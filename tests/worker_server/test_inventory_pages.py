"""A node's blob inventory and manifest list come in pages, so a node holding more than one
answer can carry (MAX_JSON_BODY_BYTES) is still listed whole: a real node process holding
more tiny blobs and manifests than one page, listed page by page over one connection."""

from __future__ import annotations

import hashlib

import pytest

from smoltorrent import defaults
from smoltorrent.errors import ProtocolError
from tests.nodeproc import start_node
from worker_server import protocol, wire

BLOBS = 2500
PAGE = 1000  # three pages: 1000, 1000, 500


@pytest.fixture
def node(tmp_path):
    """A node whose data dir holds BLOBS tiny verified blobs and BLOBS manifests, laid out as
    puts leave them (named by their SHA-256, in buckets by its first two hex digits)."""
    data = tmp_path / "node"
    node = start_node(data)
    held = {}
    for i in range(BLOBS):
        body = f"blob {i}".encode()
        digest = hashlib.sha256(body).hexdigest()
        (data / "blobs" / digest[:2]).mkdir(parents=True, exist_ok=True)
        (data / "blobs" / digest[:2] / digest).write_bytes(body)
        (data / "manifests" / f"m{i:05d}.json").write_text("{}")
        held[digest] = len(body)
    yield node, held
    node.stop()


def test_an_inventory_larger_than_a_page_is_listed_whole(node):
    node, held = node
    client = node.client()
    assert client.list_blobs(page_entries=PAGE) == held
    assert client.list_blobs() == held  # the default page holds them all at once
    keys = [f"m{i:05d}" for i in range(BLOBS)]
    assert client.list_manifests(page_entries=PAGE) == keys
    assert client.list_manifests() == keys


def test_each_page_holds_at_most_its_limit_and_says_whether_more_follow(node):
    node, held = node
    pages, after = [], None
    with node.client()._connection() as sock:
        while True:
            header = {"op": "list", "limit": PAGE} | ({} if after is None else {"after": after})
            wire.send_frame(sock, header)
            response, body_len = wire.recv_response(sock, "node")
            page = wire.recv_json_body(sock, body_len)
            pages.append((len(page), response["more"]))
            if not response["more"]:
                break
            after = max(page)
            assert list(page) == sorted(page)  # in digest order
    assert pages == [(PAGE, True), (PAGE, True), (BLOBS - 2 * PAGE, False)]


def test_a_limit_outside_the_page_size_is_refused():
    for limit in (0, defaults.LIST_PAGE_ENTRIES + 1, "10", True):
        with pytest.raises(ProtocolError):
            protocol.validate_request({"op": "list", "limit": limit})
    with pytest.raises(ProtocolError):
        protocol.validate_request({"op": "list", "after": "not a digest"})


def test_a_full_page_of_the_longest_entries_fits_one_answer():
    longest_blob = {f"{i:064x}": defaults.MAX_BLOB_BYTES for i in range(defaults.LIST_PAGE_ENTRIES)}
    assert len(protocol.encode_json(longest_blob)) <= defaults.MAX_JSON_BODY_BYTES
    longest_key = [f"{i:0{defaults.MAX_KEY_CHARS}d}" for i in range(defaults.LIST_PAGE_ENTRIES)]
    assert len(protocol.encode_json(longest_key)) <= defaults.MAX_JSON_BODY_BYTES
