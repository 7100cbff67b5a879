"""The cluster key: the one secret every node, worker and CLI of a cluster shares.

`smoltorrent init` writes it once as a file (<home>/cluster.key, mode 0600); it is
copied to every machine and read from there:

  a node       --cluster-key TEXT, else --key-file PATH, else SMOLTORRENT_CLUSTER_KEY,
               else the file SMOLTORRENT_CLUSTER_KEY_FILE names. Never the home's file
               by itself: a key makes a node listen beyond loopback, and that must be
               asked for, not follow from a file lying around.
  coordinator  SMOLTORRENT_CLUSTER_KEY, else SMOLTORRENT_CLUSTER_KEY_FILE, else
               <home>/cluster.key when it exists (coordinator/config.py).

The key is the file's text without surrounding whitespace, so a file and the variable
holding the same text are the same key. Standard library only: storage nodes read it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from smoltorrent import durable
from smoltorrent.errors import ConfigError

KEY_ENV = "SMOLTORRENT_CLUSTER_KEY"
KEY_FILE_ENV = "SMOLTORRENT_CLUSTER_KEY_FILE"
KEY_FILE_NAME = "cluster.key"  # in the home directory (SMOLTORRENT_HOME, ~/.smoltorrent)
KEY_BYTES = 32  # random bytes in a new key (64 hex digits): 256 bits, HMAC-SHA256's size
HOW_TO_SET = (
    "make one with `smoltorrent init` (it writes ~/.smoltorrent/cluster.key), copy that file"
    " to this machine and pass `--key-file PATH` (or set SMOLTORRENT_CLUSTER_KEY_FILE=PATH)"
)


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The key in the file at path; ConfigError (naming the path) if it cannot be read or
    holds no key."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(
            f"cannot read the cluster key file {path}: {reason}; copy the key file `smoltorrent"
            " init` wrote to this path, or fix --key-file / SMOLTORRENT_CLUSTER_KEY_FILE"
        ) from None
    if not text:
        raise ConfigError(
            f"the cluster key file {path} is empty: copy the one `smoltorrent init` wrote"
        )
    return text.encode("utf-8")


def key_from_env() -> bytes | None:
    """SMOLTORRENT_CLUSTER_KEY, else the file SMOLTORRENT_CLUSTER_KEY_FILE names, else None."""
    text = os.environ.get(KEY_ENV)
    if text:
        return text.encode("utf-8")
    path = os.environ.get(KEY_FILE_ENV)
    return read_key_file(path) if path else None


def create_key_file(path: Path, *, force: bool = False) -> None:
    """Write a new random key to path, mode 0600 from its first byte on. ConfigError if the
    file exists and not force (a key in use replaced would lock every node out)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (secrets.token_hex(KEY_BYTES) + "\n").encode("ascii")
    if force:
        durable.replace_file(path, data)  # its temp file is made 0600 (mkstemp)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{path} already exists: it is this cluster's key, and every node and machine"
            " uses it. Keep it, or pass --force to make a new one (then copy it to every"
            " machine and restart the nodes)"
        ) from None
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is narrowed by the umask, never widened
        os.write(fd, data)
        durable.sync(fd)
    finally:
        os.close(fd)
    durable.sync_path(path.parent)
