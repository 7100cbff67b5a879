"""Early writeback: asked for each chunk a sequential run of writes grows by, on real files,
and harmless where the kernel will not take it (durability stays with the fsync)."""

from __future__ import annotations

import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from worker_server import writeback
from worker_server.blob_store import BlobStore

MIB = 1024 * 1024


def test_a_run_of_writes_starts_writeback_once_per_chunk_behind_it(tmp_path, monkeypatch):
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(writeback, "start", lambda fd, off, n: asked.append((off, n)) or True)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        trail = writeback.Trail(fd, offset=100, chunk=4 * MIB)
        for end in (1, 3, 5, 6, 9, 12):
            trail.wrote(100 + end * MIB)
    finally:
        os.close(fd)
    # From the run's own start, never before it; each range once; the last 3 MiB wait
    # for the fsync.
    assert asked == [(100, 5 * MIB), (100 + 5 * MIB, 4 * MIB)]


def test_writes_scattered_over_a_file_start_its_writeback_once_per_chunk_written(
    tmp_path, monkeypatch
):
    """A chunked gather's threads write their chunks anywhere in the file: every 4 MiB
    written in all, wherever, the whole file's writeback is started once."""
    asked: list[int] = []
    monkeypatch.setattr(writeback, "start_all", lambda fd: asked.append(fd) or True)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        written = writeback.Scattered(fd, chunk=4 * MIB)
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(written.wrote, [MIB // 2] * 20 + [3 * MIB] * 3))  # 19 MiB
    finally:
        os.close(fd)
    assert asked == [fd] * 4  # the last 3 MiB wait for the fsync


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_kernel_takes_a_written_range_of_a_real_file(tmp_path):
    assert writeback.supported()
    path = tmp_path / "f"
    data = os.urandom(3 * MIB)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, data)
        assert writeback.start(fd, 0, len(data))
        assert writeback.start_all(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_an_fd_that_is_no_file_loses_only_the_overlap(tmp_path):
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"x" * 10)
        assert writeback.start(write_end, 0, 10) is False
        assert writeback.start(write_end, 0, 0) is False
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_blob_received_in_many_chunks_is_published_whole(tmp_path):
    """The node's receive path starts writeback as the blob grows; what it publishes is
    still exactly the bytes it hashed."""
    store = BlobStore(tmp_path / "data")
    try:
        data = os.urandom(40 * MIB + 12345)
        digest = hashlib.sha256(data).hexdigest()
        view = memoryview(data)
        with store.begin_put(digest, len(data)) as incoming:
            for at in range(0, len(data), MIB):
                incoming.write(view[at : at + MIB])
            incoming.commit()
        assert store.blob_path(digest).read_bytes() == data
    finally:
        store.close()
