"""Chunked store and gather through real node processes: encoded on the nodes, byte-identical
back, unchanged tensors never encoded nor sent again, a bad copy read from another replica."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordinator.dataplane import codec
from coordinator.dataplane.chunk_engine import store_chunked
from coordinator.dataplane.gather_engine import gather_checkpoint
from coordinator.dataplane.node_client import NodeClient
from coordinator.dataplane.partial_engine import gather_tensors
from coordinator.local.synthetic import write_checkpoint
from coordinator.plan.safetensors_header import read_header
from coordinator.plan.selection import select
from smoltorrent import defaults
from tests.nodeproc import NodeProcess, node_metric, start_node
from worker_server import writeback

ACCEPTED = "smoltorrent_node_connections_accepted_total"


@pytest.fixture
def nodes(tmp_path):
    started = [start_node(tmp_path / f"node{i}") for i in range(4)]
    yield started
    for node in started:
        node.kill()


@pytest.fixture
def keyed_nodes(tmp_path):
    """Four nodes with a cluster key (every connection pays the handshake) that count the
    connections they accept on /metrics."""
    env = dict(os.environ, SMOLTORRENT_METRICS_PORT="0")
    started = [NodeProcess(tmp_path / f"node{i}", KEY, env=env).start() for i in range(4)]
    yield started
    for node in started:
        node.kill()


KEY = b"chunk-engine-test-key"


class ChunksRoom:
    """What Redis's chunks room (coordinator/state/chunks.py) answers a store, in a dict:
    each chunk recorded is found again by (raw digest, encoding) where its blob was made
    with that encoding or is RAW. `asked`: the raw digests looked up, in order."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, int, str]] = {}
        self.asked: list[str] = []

    def record(self, prepared) -> None:
        for c in prepared.manifest.chunks:
            made = prepared.encodings[c.index]
            self.entries[c.raw_sha256] = (c.blob_sha256, c.blob_size, made)

    def __call__(self, keys):
        self.asked.extend(raw for raw, _ in keys)
        return {
            (raw, encoding): entry[:2]
            for raw, encoding in keys
            if (entry := self.entries.get(raw)) and entry[2] in (encoding, codec.RAW_ENCODING)
        }


FREE = {"a": 1 << 40, "b": 1 << 40}  # two nodes with room for anything


def bf16_model(layers: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights N(0, 0.02) (up_proj 1 MiB: a chunk of its own), fp32 norms, and an
    embedding of 20 MiB, cut in two chunks."""
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {"embed.weight": weight(10240, 1024)}
    for i in range(layers):
        tensors |= {
            f"layers.{i}.q_proj.weight": weight(256, 512),
            f"layers.{i}.norm.weight": torch.ones(512, dtype=torch.float32),
            f"layers.{i}.up_proj.weight": weight(1024, 512),
        }
    return tensors


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gather(result, nodes, out: Path, first=None, key=None, threads=None):
    by_id = {NodeClient(n.address, cluster_key=key).ping(): n for n in nodes}
    sources = []
    for index in range(len(result.manifest.chunks)):
        holders = sorted((by_id[h] for h in result.holders[index]), key=lambda n: n is not first)
        sources.append([NodeClient(n.address, cluster_key=key) for n in holders])
    accepted = [node_metric(n, ACCEPTED) for n in nodes] if key else []
    more = {} if threads is None else {"threads": threads}
    report = gather_checkpoint(result.manifest, sources, out, **more)
    if key:
        report.connections = [
            node_metric(n, ACCEPTED) - a for n, a in zip(nodes, accepted, strict=True)
        ]
    return report


def blob_files(nodes) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for node in nodes:
        for path in (node.data_dir / "blobs").rglob("*"):
            if path.is_file() and len(path.name) == 64:
                found.setdefault(path.name, []).append(path)
    return found


def test_a_chunked_store_keeps_encoded_chunks_and_gathers_byte_identical(nodes, tmp_path):
    src = tmp_path / "model.safetensors"
    save_file(bf16_model(), src)
    result = store_chunked(src, [n.address for n in nodes], tmp_path / "spool", replicas=2)
    manifest = result.manifest
    assert manifest.chunked and len(manifest.chunks) >= 6
    assert all(len(h) == 2 for h in result.holders.values())
    files = blob_files(nodes)
    assert set(files) == {c.blob_sha256 for c in manifest.chunks}
    for chunk in manifest.chunks:
        for path in files[chunk.blob_sha256]:
            data = path.read_bytes()
            assert data[:4] == codec.MAGIC and len(data) == chunk.blob_size
    raw = read_header(src).data_size
    stored = sum(c.blob_size for c in manifest.chunks)
    assert stored < raw / 1.3  # bf16 weights byte-grouped: about 1.46x
    assert list((tmp_path / "spool").iterdir()) == []  # the spool is emptied

    out = tmp_path / "out.safetensors"
    gather(result, nodes, out)
    assert sha(out) == sha(src)


def test_a_fine_tune_encodes_and_sends_only_the_changed_matrices(nodes, tmp_path):
    first, second = tmp_path / "step1.safetensors", tmp_path / "step2.safetensors"
    tensors = bf16_model()
    save_file(tensors, first)
    changed = [n for n in tensors if n.endswith("up_proj.weight")]
    for name in changed:
        tensors[name] = tensors[name] + torch.full_like(tensors[name], 0.001)
    save_file(tensors, second)
    addresses = [n.address for n in nodes]
    v1 = store_chunked(first, addresses, tmp_path / "spool", replicas=2)
    known = {c.raw_sha256: (c.blob_sha256, c.blob_size) for c in v1.manifest.chunks}
    v2 = store_chunked(second, addresses, tmp_path / "spool", replicas=2, known=known)

    header = read_header(second)
    changed_bytes = sum(t.size for t in header.tensors if t.name in changed)
    assert v2.encoded_raw_bytes == changed_bytes
    new = [c for c in v2.manifest.chunks if c.raw_sha256 not in known]
    assert sum(c.data_end - c.data_start for c in new) == changed_bytes
    assert v2.bytes_sent == 2 * sum(c.blob_size for c in new)
    assert v2.bytes_sent < 0.2 * 2 * header.data_size

    for result, src in ((v1, first), (v2, second)):
        out = tmp_path / f"out-{src.name}"
        gather(result, nodes, out)
        assert sha(out) == sha(src)


def test_a_corrupt_chunk_is_read_from_another_replica_and_reported(nodes, tmp_path):
    src = tmp_path / "model.safetensors"
    save_file(bf16_model(layers=2), src)
    result = store_chunked(src, [n.address for n in nodes], tmp_path / "spool", replicas=2)
    chunk = max(result.manifest.chunks, key=lambda c: c.blob_size)
    by_id = {NodeClient(n.address).ping(): n for n in nodes}
    victim = by_id[result.holders[chunk.index][0]]
    path = next((victim.data_dir / "blobs").rglob(chunk.blob_sha256))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    out = tmp_path / "out.safetensors"
    report = gather(result, nodes, out, first=victim)
    assert sha(out) == sha(src)
    assert [(b.shard, b.digest) for b in report.bad_copies] == [(chunk.index, chunk.blob_sha256)]
    assert report.served_by[chunk.index] != str(victim.address)


def test_a_store_told_not_to_encode_keeps_raw_chunks_a_later_one_reuses(nodes, tmp_path):
    """A link faster than the encoder: every chunk RAW, sent from the source; the same
    content stored again with encoding, told the first store's chunks, moves nothing."""
    src = tmp_path / "model.safetensors"
    save_file(bf16_model(layers=2), src)
    addresses = [n.address for n in nodes]
    plain = store_chunked(src, addresses, tmp_path / "spool", replicas=2, encode=False)
    for chunk in plain.manifest.chunks:  # kept as they are, hashed once: one digest
        assert chunk.blob_size == chunk.data_end - chunk.data_start
        assert chunk.blob_sha256 == chunk.raw_sha256
    known = {c.raw_sha256: (c.blob_sha256, c.blob_size) for c in plain.manifest.chunks}
    again = store_chunked(src, addresses, tmp_path / "spool", replicas=2, known=known)
    assert again.manifest.version_id == plain.manifest.version_id
    assert (again.bytes_sent, again.encoded_raw_bytes) == (0, 0)
    out = tmp_path / "out.safetensors"
    gather(plain, nodes, out)
    assert sha(out) == sha(src)


def test_incompressible_chunks_are_stored_raw_and_gather_byte_identical(nodes, tmp_path):
    src = tmp_path / "random.safetensors"
    write_checkpoint(src, 24 * 1024 * 1024, hidden=512)  # random bytes: nothing to gain
    result = store_chunked(src, [n.address for n in nodes], tmp_path / "spool", replicas=2)
    for chunk in result.manifest.chunks:
        assert chunk.blob_size == chunk.data_end - chunk.data_start
        assert chunk.blob_sha256 == chunk.raw_sha256
    out = tmp_path / "out.safetensors"
    gather(result, nodes, out)
    assert sha(out) == sha(src)


def test_a_chunk_that_does_not_decode_is_read_from_another_replica(nodes, tmp_path):
    """A copy whose header no longer decodes fails at its first bytes, before any digest
    could: the gather reads the next replica and reports the bad copy."""
    src = tmp_path / "model.safetensors"
    save_file(bf16_model(layers=1), src)
    result = store_chunked(src, [n.address for n in nodes], tmp_path / "spool", replicas=2)
    chunk = result.manifest.chunks[0]
    by_id = {NodeClient(n.address).ping(): n for n in nodes}
    victim = by_id[result.holders[chunk.index][0]]
    path = next((victim.data_dir / "blobs").rglob(chunk.blob_sha256))
    path.write_bytes(b"XXXX" + path.read_bytes()[4:])  # no longer the chunk magic

    out = tmp_path / "out.safetensors"
    report = gather(result, nodes, out, first=victim)
    assert sha(out) == sha(src)
    (bad,) = report.bad_copies
    assert bad.shard == chunk.index and "magic" in bad.reason


@pytest.mark.parametrize("content", ["encoded", "raw"])
def test_a_gather_reads_every_chunk_of_a_node_over_as_many_connections_as_threads(
    keyed_nodes, tmp_path, content
):
    """Connections are kept across chunks: a node serving many chunks to 2 threads accepts
    at most 2 connections (one per chunk before: a connect, a node thread and the key
    handshake per few MB read)."""
    src = tmp_path / "model.safetensors"
    if content == "encoded":
        save_file(bf16_model(layers=12), src)
    else:
        write_checkpoint(src, 40 * 1000 * 1000, hidden=512)  # random bytes: RAW chunks
    addresses = [n.address for n in keyed_nodes]
    result = store_chunked(src, addresses, tmp_path / "spool", replicas=2, cluster_key=KEY)
    chunks = result.manifest.chunks
    assert len(chunks) >= 20
    assert any(c.blob_size != c.data_end - c.data_start for c in chunks) == (content == "encoded")
    out = tmp_path / "out.safetensors"
    report = gather(result, keyed_nodes, out, key=KEY, threads=2)
    assert sha(out) == sha(src)
    served = [list(report.served_by.values()).count(str(n.address)) for n in keyed_nodes]
    assert sum(served) == len(chunks) and max(served) > 2
    assert all(c <= 2 for c in report.connections), (served, report.connections)


def test_a_partial_gather_of_many_chunks_keeps_its_connections(keyed_nodes, tmp_path):
    """A partial load of tensors spread over many chunks reads them over kept connections,
    as a whole gather does: at most one per thread a node serves, not one per chunk."""
    src = tmp_path / "model.safetensors"
    save_file(bf16_model(layers=12), src)
    addresses = [n.address for n in keyed_nodes]
    result = store_chunked(src, addresses, tmp_path / "spool", replicas=2, cluster_key=KEY)
    manifest = result.manifest
    selection = select(manifest, ["layers.*.q_proj.weight", "layers.*.up_proj.weight"])
    assert len(selection.reads) >= 12
    by_id = {NodeClient(n.address, cluster_key=KEY).ping(): n for n in keyed_nodes}
    sources = [
        [NodeClient(by_id[h].address, cluster_key=KEY) for h in result.holders[index]]
        for index in range(len(manifest.chunks))
    ]
    accepted = [node_metric(n, ACCEPTED) for n in keyed_nodes]
    part = tmp_path / "part.safetensors"
    gather_tensors(manifest, selection, sources, part, threads=2)
    connections = [node_metric(n, ACCEPTED) - a for n, a in zip(keyed_nodes, accepted, strict=True)]
    expected = bf16_model(layers=12)
    loaded = load_file(part)
    assert sorted(loaded) == sorted(n for n in expected if "proj" in n)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name
    assert all(c <= 2 for c in connections), connections


def test_a_chunked_gather_starts_the_writeback_of_its_file_as_chunks_land(
    nodes, tmp_path, monkeypatch
):
    """No chunk is the 16 MiB a blob's own receive waits for before its writeback: the
    gather starts the whole file's, every 16 MiB of chunks (its fsync found 1 GB dirty)."""
    asked: list[int] = []
    real = writeback.start_all
    monkeypatch.setattr(writeback, "start_all", lambda fd: asked.append(fd) or real(fd))
    src = tmp_path / "model.safetensors"
    write_checkpoint(src, 40 * 1000 * 1000, hidden=512)
    result = store_chunked(src, [n.address for n in nodes], tmp_path / "spool", replicas=2)
    assert max(c.data_end - c.data_start for c in result.manifest.chunks) < 16 * 1024 * 1024
    out = tmp_path / "out.safetensors"
    gather(result, nodes, out)
    assert sha(out) == sha(src)
    data = read_header(src).data_size
    assert len(asked) == data // defaults.WRITEBACK_CHUNK_BYTES >= 2


def test_a_node_that_does_not_answer_one_chunk_is_tried_last_for_the_others(nodes, tmp_path):
    """A node that stops answering (SIGSTOP: connections open, nothing answers) and is the
    first replica of half the chunks: the gather falls back for the chunks its threads
    were reading from it, then reads the rest from the other replicas first. Before, every
    one of those chunks waited out the read timeout on it."""
    src = tmp_path / "model.safetensors"
    write_checkpoint(src, 40 * 1000 * 1000, hidden=512)  # random bytes: RAW chunks
    result = store_chunked(src, [n.address for n in nodes], tmp_path / "spool", replicas=2)
    silent = nodes[1]
    silent_id = NodeClient(silent.address).ping()
    by_id = {NodeClient(n.address).ping(): n for n in nodes}
    sources = []
    for index in range(len(result.manifest.chunks)):
        holders = sorted((by_id[h] for h in result.holders[index]), key=lambda n: n is not silent)
        sources.append([NodeClient(n.address, timeout=1.0) for n in holders])
    first_on_silent = sum(silent_id in result.holders[i] for i in range(len(sources)))
    assert first_on_silent >= 8, "too few chunks on the node: the test shows nothing"
    silent.send_signal(signal.SIGSTOP)
    try:
        out = tmp_path / "out.safetensors"
        report = gather_checkpoint(result.manifest, sources, out, threads=2)
    finally:
        silent.send_signal(signal.SIGCONT)
    assert sha(out) == sha(src)
    assert str(silent.address) not in report.served_by.values()
    waited = [line for line in report.fallbacks if str(silent.address) in line]
    assert 1 <= len(waited) <= 2, waited  # the reads under way when it went silent


def test_a_version_whose_raw_chunks_were_kept_behind_a_header_still_gathers(nodes, tmp_path):
    """Before RAW chunks were kept bare, a node kept each behind a chunk header (its blob
    HEADER_BYTES longer than its raw bytes, with a digest of its own). Such a version
    gathers whole and in part, byte-identical, and the header is never written out."""
    src = tmp_path / "model.safetensors"
    save_file(bf16_model(layers=2), src)
    stored = store_chunked(src, [n.address for n in nodes], tmp_path / "spool", encode=False)
    header = read_header(src)
    old_chunks = []
    with open(src, "rb") as source:
        for chunk in stored.manifest.chunks:
            length = chunk.data_end - chunk.data_start
            source.seek(header.data_start + chunk.data_start)
            blob = codec.raw_header(length) + source.read(length)
            digest = hashlib.sha256(blob).hexdigest()
            scratch = tmp_path / "blob"
            scratch.write_bytes(blob)
            with open(scratch, "rb") as f:
                for node in nodes[:2]:
                    NodeClient(node.address).put_blob(digest, b"", f.fileno(), 0, len(blob))
            old_chunks.append(dataclasses.replace(chunk, blob_size=len(blob), blob_sha256=digest))
    old = dataclasses.replace(stored.manifest, chunks=tuple(old_chunks))
    sources = [[NodeClient(n.address) for n in nodes[:2]] for _ in old.chunks]

    out = tmp_path / "out.safetensors"
    report = gather_checkpoint(old, sources, out)
    assert sha(out) == sha(src) and not report.bad_copies

    part = tmp_path / "part.safetensors"
    gather_tensors(old, select(old, ["layers.1.*"]), sources, part)
    expected = bf16_model(layers=2)
    loaded = load_file(part)
    assert sorted(loaded) == sorted(n for n in expected if n.startswith("layers.1."))
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


def _counting_reads(monkeypatch) -> list[int]:
    """The chunk indexes prepare_chunked_store reads (a hash pass or an encode), in order."""
    from coordinator.dataplane import chunk_engine

    reads: list[int] = []
    raw_digest, encode_one = chunk_engine._raw_digest, chunk_engine.encode_one

    def hashing(path, header, plan):
        reads.append(plan.index)
        return raw_digest(path, header, plan)

    def encoding(path, header, plan, spool):
        reads.append(plan.index)
        return encode_one(path, header, plan, spool)

    monkeypatch.setattr(chunk_engine, "_raw_digest", hashing)
    monkeypatch.setattr(chunk_engine, "encode_one", encoding)
    return reads


def test_a_first_store_of_new_content_reads_each_chunk_once(tmp_path, monkeypatch):
    """Content the lookup knows none of is hashed and encoded in one pass per chunk: only
    the first chunks, hashed alone until CHUNKS_NEW_BEFORE_ONE_PASS of them in a row were
    found new, are read twice. A fine-tune's store still encodes only what changed."""
    from coordinator.dataplane.chunk_engine import prepare_chunked_store

    tensors = bf16_model(layers=10)
    first, second = tmp_path / "step1.safetensors", tmp_path / "step2.safetensors"
    save_file(tensors, first)
    room = ChunksRoom()

    def prepare(src):
        p = prepare_chunked_store(src, src.name, FREE, tmp_path / "spool", lookup=room)
        room.record(p)
        return p

    reads = _counting_reads(monkeypatch)
    v1 = prepare(first)
    chunks = v1.manifest.chunks
    assert len(chunks) >= 20 and not v1.known
    twice = [i for i in set(reads) if reads.count(i) > 1]
    assert sorted(set(reads)) == list(range(len(chunks)))
    assert len(twice) <= defaults.CHUNKS_NEW_BEFORE_ONE_PASS + defaults.HASH_THREADS - 1
    assert all(i < len(twice) + defaults.HASH_THREADS for i in twice)  # the first ones only
    assert set(room.asked) == {c.raw_sha256 for c in chunks}  # every new chunk looked up
    assert v1.hashed_bytes == read_header(first).data_size

    changed = [n for n in tensors if n.endswith("up_proj.weight")]
    for name in changed:
        tensors[name] = tensors[name] + torch.full_like(tensors[name], 0.001)
    save_file(tensors, second)
    v2 = prepare(second)
    header = read_header(second)
    changed_bytes = sum(t.size for t in header.tensors if t.name in changed)
    new = [c.index for c in v2.manifest.chunks if c.index not in v2.known]
    assert sum(v2.manifest.chunks[i].data_end - v2.manifest.chunks[i].data_start for i in new) == (
        changed_bytes
    )
    assert v2.encoded_raw_bytes == changed_bytes
    assert {os.path.basename(s.spool) for s in v2.spans if s.spool} == {f"{i}.chunk" for i in new}
    assert sorted(os.listdir(v2.spool)) == sorted(f"{i}.chunk" for i in new)
    # The same blobs as a store that hashed every chunk first would name.
    monkeypatch.undo()
    room.entries.clear()
    again = prepare(second)
    assert again.manifest.chunks == v2.manifest.chunks


def test_byte_identical_chunks_of_new_content_are_spooled_once(tmp_path):
    """Every norm at ones: their chunks have one raw digest, and the store keeps one
    encoded copy, the first one's, whether it hashed them first or encoded them at once."""
    from coordinator.dataplane.chunk_engine import prepare_chunked_store

    tensors = {f"n{i}.weight": torch.ones(1 << 19, dtype=torch.float32) for i in range(8)}
    src = tmp_path / "norms.safetensors"
    save_file(tensors, src)
    p = prepare_chunked_store(src, src.name, FREE, tmp_path / "spool", lookup=lambda raws: {})
    raws = {c.raw_sha256 for c in p.manifest.chunks}
    assert len(p.manifest.chunks) == 8 and len(raws) == 1
    assert len({c.blob_sha256 for c in p.manifest.chunks}) == 1
    assert os.listdir(p.spool) == ["0.chunk"]
    assert p.known == frozenset(range(1, 8))
