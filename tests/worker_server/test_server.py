"""Every operation through NodeClient against shard servers running as real processes."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from smoltorrent import defaults
from smoltorrent.errors import DigestMismatchError, NodeError, ProtocolError
from tests.nodeproc import NodeProcess
from tests.worker_server.conftest import SourceBlob

CONCURRENT_TRANSFERS = 40  # more than 32 at once, as a store with many shards would make


def test_ping_and_stat(keyed_node: NodeProcess) -> None:
    client = keyed_node.client()
    node_id = client.ping()
    stat = client.stat()
    assert stat.node_id == node_id
    assert stat.protocol_version == defaults.PROTOCOL_VERSION
    assert 0 < stat.free_bytes <= stat.total_bytes


def test_put_get_has_list_delete(keyed_node: NodeProcess, make_blob, tmp_path: Path) -> None:
    client = keyed_node.client()
    blob: SourceBlob = make_blob(300_000)
    assert blob.put(client) is True
    assert blob.put(client) is False  # already there: no body is sent
    assert client.has([blob.digest, "0" * 64]) == {blob.digest}
    assert client.list_blobs()[blob.digest] == len(blob.content)
    assert client.get_range(blob.digest, 2, 5) == blob.content[2:7]

    out_path = tmp_path / "out"
    out_path.write_bytes(b"\0" * 10)
    seen: list[int] = []
    with open(out_path, "r+b") as out:
        digest = client.get_blob_to_file(
            blob.digest, out.fileno(), 10, skip=len(blob.prefix), progress=seen.append
        )
    assert digest == blob.digest
    assert out_path.read_bytes() == b"\0" * 10 + blob.content[len(blob.prefix) :]
    assert sum(seen) == len(blob.content)

    assert client.delete(blob.digest) is True
    assert client.delete(blob.digest) is False
    assert client.has([blob.digest]) == set()
    with pytest.raises(NodeError) as missing:
        client.get_range(blob.digest, 0, 1)
    assert missing.value.code == "not_found"


def test_empty_blob(keyed_node: NodeProcess, make_blob) -> None:
    blob: SourceBlob = make_blob(0, prefix=b"")
    client = keyed_node.client()
    assert blob.put(client) is True
    assert client.get_range(blob.digest, 0, 0) == b""


def test_range_outside_the_blob_is_a_bad_request(keyed_node: NodeProcess, make_blob) -> None:
    blob: SourceBlob = make_blob(100)
    client = keyed_node.client()
    blob.put(client)
    with pytest.raises(NodeError) as outside:
        client.get_range(blob.digest, 50, 100)
    assert outside.value.code == "bad_request"


def test_wrong_digest_is_refused_and_nothing_stored(keyed_node: NodeProcess, make_blob) -> None:
    blob: SourceBlob = make_blob(200_000)
    client = keyed_node.client()
    wrong = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(DigestMismatchError, match="send it again"):
        client.put_blob(wrong, blob.prefix, blob.fd, blob.offset, blob.length)
    assert client.has([wrong]) == set()
    assert list((keyed_node.data_dir / "tmp").iterdir()) == []
    assert client.ping()


def test_invalid_digest_is_refused_by_the_node(keyed_node: NodeProcess, make_blob) -> None:
    blob: SourceBlob = make_blob(10)
    with pytest.raises(NodeError) as refused:
        keyed_node.client().put_blob("../../x", blob.prefix, blob.fd, blob.offset, blob.length)
    assert refused.value.code == "bad_request"


def test_verify_finds_a_flipped_bit(node_factory, make_blob) -> None:
    node: NodeProcess = node_factory()
    client = node.client()
    good, bad = make_blob(5000), make_blob(5000)
    good.put(client)
    bad.put(client)
    path = node.data_dir / "blobs" / bad.digest[:2] / bad.digest
    data = bytearray(path.read_bytes())
    data[1234] ^= 0x10
    path.write_bytes(data)
    with (
        open(os.devnull, "wb") as sink,
        pytest.raises(DigestMismatchError, match="another replica"),
    ):
        client.get_blob_to_file(bad.digest, sink.fileno(), 0)
    assert client.verify() == [bad.digest]
    assert client.verify([good.digest]) == []
    # Over a thousand digests go in several requests on one connection.
    many = [good.digest] + [f"{n:064x}" for n in range(1, 1200)]
    assert sorted(client.verify(many)) == sorted(many[1:])
    # The bad copy is out of reads now, kept aside until a good one exists.
    assert (node.data_dir / "quarantine" / bad.digest).read_bytes() == bytes(data)
    assert client.has([bad.digest]) == set()


def test_node_id_and_blobs_survive_restarts(node_factory, make_blob) -> None:
    node: NodeProcess = node_factory()
    blob: SourceBlob = make_blob(1000)
    node_id = node.client().ping()
    blob.put(node.client())
    assert node.stop() == 0
    assert not (node.data_dir / "port").exists()
    node.restart()
    assert node.client().ping() == node_id
    node.kill()  # a power cut: no clean shutdown at all
    node.restart()
    assert node.client().ping() == node_id
    assert node.client().has([blob.digest]) == {blob.digest}


def test_replicate_pushes_to_a_peer(node_factory, make_blob) -> None:
    source, target = node_factory("source"), node_factory("target")
    blob: SourceBlob = make_blob(2_000_000)
    blob.put(source.client())
    assert source.client().replicate(blob.digest, target.address) is True
    assert source.client().replicate(blob.digest, target.address) is False
    assert target.client().get_range(blob.digest, 0, len(blob.content)) == blob.content


def test_replicate_reports_an_unreachable_or_keyless_peer(node_factory, make_blob) -> None:
    source, keyless = node_factory("source"), node_factory("keyless", cluster_key=None)
    blob: SourceBlob = make_blob(100)
    blob.put(source.client())
    dead = node_factory("dead")
    dead_address = dead.address
    dead.kill()
    for peer in (dead_address, keyless.address):
        with pytest.raises(NodeError) as failed:
            source.client().replicate(blob.digest, peer)
        assert failed.value.code == "peer_unavailable"
        assert str(peer) in str(failed.value)
    with pytest.raises(NodeError) as missing:
        source.client().replicate("e" * 64, keyless.address)
    assert missing.value.code == "not_found"


def test_manifests(keyed_node: NodeProcess) -> None:
    client = keyed_node.client()
    client.put_manifest("grpo.run1.step_100", b'{"version": 1}')
    assert "grpo.run1.step_100" in client.list_manifests()
    assert client.get_manifest("grpo.run1.step_100") == b'{"version": 1}'
    with pytest.raises(NodeError) as not_json:
        client.put_manifest("broken", b"{not json")
    assert not_json.value.code == "bad_request"
    with pytest.raises(NodeError) as missing:
        client.get_manifest("never-written")
    assert missing.value.code == "not_found"


def test_many_concurrent_puts_and_gets(keyed_node: NodeProcess, make_blob) -> None:
    blobs: list[SourceBlob] = [make_blob(64 * 1024 + n) for n in range(CONCURRENT_TRANSFERS)]

    def round_trip(blob: SourceBlob) -> bytes:
        client = keyed_node.client()
        blob.put(client)
        return client.get_range(blob.digest, 0, len(blob.content))

    with ThreadPoolExecutor(CONCURRENT_TRANSFERS) as pool:
        results = list(pool.map(round_trip, blobs))
    assert results == [blob.content for blob in blobs]


def test_keyless_node_serves_keyless_clients(keyless_node: NodeProcess) -> None:
    assert keyless_node.client().ping()
    assert "NO CLUSTER KEY" in keyless_node.log()


def test_get_range_refuses_large_reads(keyed_node: NodeProcess) -> None:
    with pytest.raises(ValueError, match="get_blob_to_file"):
        keyed_node.client().get_range("a" * 64, 0, 1 << 30)


def test_short_source_file_fails_the_put(keyed_node: NodeProcess, make_blob) -> None:
    blob: SourceBlob = make_blob(1000)
    with pytest.raises(ProtocolError, match="source file ended"):
        keyed_node.client().put_blob(blob.digest, b"", blob.fd, 0, 10_000)
    assert keyed_node.client().has([blob.digest]) == set()


def _blob_file(node: NodeProcess, digest: str) -> Path:
    return node.data_dir / "blobs" / digest[:2] / digest


@pytest.mark.parametrize("damage", ["flipped bit", "appended bytes", "cut short"])
def test_put_of_a_damaged_copy_receives_it_again(
    node_factory, make_blob, damage: str, tmp_path: Path
) -> None:
    node = node_factory()
    client = node.client()
    blob: SourceBlob = make_blob(300_000)
    assert blob.put(client) is True
    path = _blob_file(node, blob.digest)
    data = bytearray(path.read_bytes())
    if damage == "flipped bit":
        data[1000] ^= 0x01
    elif damage == "appended bytes":
        data += os.urandom(4096)
    else:
        del data[-10:]
    path.write_bytes(bytes(data))
    assert blob.put(client) is True  # "exists" would count a damaged copy as a replica
    assert path.read_bytes() == blob.content
    assert client.verify([blob.digest]) == []
    assert blob.put(client) is False  # an intact copy still moves no body


@pytest.mark.parametrize("kind", ["put", "chain_put"])
def test_a_put_of_the_wrong_size_never_sets_aside_a_good_copy(
    node_factory, make_blob, kind: str
) -> None:
    """A put that names a blob the node holds whole, but with another size, cannot be that
    blob (its bytes could not hash to the name): it is refused, and the good copy stays in
    reads. The node took such a put for a damaged copy and quarantined the good one before
    a byte of the body arrived."""
    node = node_factory()
    client = node.client()
    blob: SourceBlob = make_blob(300_000)
    assert blob.put(client) is True
    wrong = blob.length + 7  # the source file has 7 more bytes after the range
    with pytest.raises(NodeError, match="verified; a put of") as refused:
        if kind == "put":
            client.put_blob(blob.digest, blob.prefix, blob.fd, blob.offset, wrong)
        else:
            client.chain_put(blob.digest, blob.prefix, blob.fd, blob.offset, wrong, [])
    assert refused.value.code == "bad_request"
    assert _blob_file(node, blob.digest).read_bytes() == blob.content
    assert not (node.data_dir / "quarantine" / blob.digest).exists()
    assert client.has([blob.digest]) == {blob.digest}
    assert blob.put(client) is False  # still counted whole: "exists", no body moves
