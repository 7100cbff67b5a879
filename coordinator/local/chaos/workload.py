"""The workload's contents and names: the checkpoints clients store, and the names they
store them under."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from coordinator.local.synthetic import write_checkpoint

NAMES = ("run/latest.safetensors", "run/best.safetensors", "eval/model.safetensors")
GATHER_AT_LEAST_EVERY = 3  # a client's operations between gathers at most, once it stored


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_contents(directory: Path, count: int, size: int) -> list[Path]:
    """`count` checkpoints of about `size` bytes; each after the first is the first with
    one tensor's bytes changed, so versions share blobs (what reference counting guards)."""
    directory.mkdir(parents=True, exist_ok=True)
    base = directory / "content0.safetensors"
    write_checkpoint(base, size, hidden=64)
    header_len = int.from_bytes(base.read_bytes()[:8], "little")
    total = base.stat().st_size
    out = [base]
    for i in range(1, count):
        path = directory / f"content{i}.safetensors"
        data = bytearray(base.read_bytes())
        # A slice of the data section near the end (the lm_head tensor): one shard differs.
        start = max(8 + header_len, total - total // 8)
        data[start : start + 64] = os.urandom(64)
        path.write_bytes(bytes(data))
        out.append(path)
    past = time.time() - 120  # settled: no store waits for the file to stop changing
    for path in out:
        os.utime(path, (past, past))
    return out
