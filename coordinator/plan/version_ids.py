"""What a version is known by: its id (a hash of its content), its key (the id under a
name: what Redis and the nodes file its manifest under), and the checks on a checkpoint
name and on a version key that came from outside.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence

from coordinator.plan.manifest_checks import SHA256_HEX
from smoltorrent import defaults
from smoltorrent.errors import UnsafeNameError, UsageError

_VERSION_ID_DOMAIN = b"smoltorrent version v1\0"  # keeps these digests apart from any other
# A chunked version's id hashes raw chunk digests, never blob digests: another domain, so
# it can never equal a whole-shard version's id
_CHUNKED_VERSION_ID_DOMAIN = b"smoltorrent chunked version v1\0"


def check_name(name: str) -> str:
    """A checkpoint name as given, or UsageError if it holds a control character: a newline
    or a tab would split or shift its row in `ls` (one line per version in a pipe, cells
    split by tabs) and in every log line that names it."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise UsageError(
            f"the checkpoint name {name!r} holds a control character (newline, tab, ...);"
            " choose another (--name on the command line)"
        )
    return name


def storage_key(name: str, version_id: str) -> str:
    """The version key of `version_id` under `name` (see Manifest.storage_key)."""
    digest = hashlib.sha256(f"{name}\0{version_id}".encode()).hexdigest()
    return digest[: defaults.VERSION_KEY_CHARS]


_VERSION_KEY = re.compile(f"[0-9a-f]{{{defaults.VERSION_KEY_CHARS}}}")


def check_version_key(vkey: object) -> str:
    """`vkey` if it is a version key as storage_key makes them, else UnsafeNameError. A
    key from a broker message or Redis names a directory on the source's host (the spool's),
    so '/home/u' or '..' must never pass for one."""
    if not isinstance(vkey, str) or not _VERSION_KEY.fullmatch(vkey):
        raise UnsafeNameError(
            f"refusing the version key {str(vkey)[:80]!r}: a version key is"
            f" {defaults.VERSION_KEY_CHARS} lowercase hex digits. A message or a Redis"
            " value that says otherwise was not written by smoltorrent."
        )
    return vkey


def version_id_for(header_bytes: bytes, blob_digests: Sequence[str]) -> str:
    """SHA-256 over the header and the ordered blob digests, each length-framed.

    Header and blobs together determine every byte of the source, so equal
    ids mean equal content; the framing keeps two different (header,
    digests) pairs from hashing the same concatenation.
    """
    return _version_id(_VERSION_ID_DOMAIN, header_bytes, blob_digests)


def chunked_version_id(header_bytes: bytes, raw_digests: Sequence[str]) -> str:
    """A chunked version's id: as version_id_for, over the chunks' raw digests, so it does
    not depend on how the chunks were encoded."""
    return _version_id(_CHUNKED_VERSION_ID_DOMAIN, header_bytes, raw_digests)


def _version_id(domain: bytes, header_bytes: bytes, digests: Sequence[str]) -> str:
    digest = hashlib.sha256(domain)
    digest.update(struct.pack("<Q", len(header_bytes)))
    digest.update(header_bytes)
    digest.update(struct.pack("<Q", len(digests)))
    for one in digests:
        if not SHA256_HEX.fullmatch(one):
            raise ValueError(f"a digest must be 64 lowercase hex digits, got {one!r}")
        digest.update(bytes.fromhex(one))
    return digest.hexdigest()
