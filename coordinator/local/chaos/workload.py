"""The workload's contents and names: every store writes bytes no other store wrote, so a
gather's digest names the store (or the rollbacks of it) it came from."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from coordinator.local.synthetic import write_checkpoint

NAMES = ("run/latest.safetensors", "run/best.safetensors", "eval/model.safetensors")
GATHER_AT_LEAST_EVERY = 3  # a client's operations between gathers at most, once it stored
TAG_BYTES = 64  # bytes of one tensor each store sets to its own: two SHA-256s of its tag
SETTLED_AGE_S = 120  # a source's mtime this far back: no store waits for it to stop changing


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Contents:
    """One base checkpoint of about `size` bytes; each store's content is the base with
    TAG_BYTES of one tensor (the lm_head, near the end) set from a tag of its own. So
    every store's bytes are unique (its digest names it), and versions still share every
    other blob, which reference counting guards."""

    def __init__(self, directory: Path, size: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        base = directory / "base.safetensors"
        write_checkpoint(base, size, hidden=64)
        self.base = base.read_bytes()
        header_len = int.from_bytes(self.base[:8], "little")
        self.offset = max(8 + header_len, len(self.base) - len(self.base) // 8)

    def bytes_for(self, tag: str) -> bytes:
        mark = hashlib.sha256(tag.encode()).digest()
        mark = (mark + hashlib.sha256(mark).digest())[:TAG_BYTES]
        data = bytearray(self.base)
        data[self.offset : self.offset + TAG_BYTES] = mark
        return bytes(data)

    def write(self, path: Path, tag: str) -> str:
        """The content of `tag` at `path`, settled; its SHA-256."""
        data = self.bytes_for(tag)
        path.write_bytes(data)
        past = time.time() - SETTLED_AGE_S
        os.utime(path, (past, past))
        return hashlib.sha256(data).hexdigest()
