"""Client side of the wire protocol: one NodeClient talks to one shard server.

INTERFACE STUB (helper A implements it). Every method opens its own
connection (auth handshake included), so a client object is cheap and
thread-safe. Network failures raise NodeUnavailableError; error frames
raise NodeError (code attribute) or a subclass-specific error.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> NodeAddress:
        """'host:port' or '[v6]:port' -> NodeAddress; SmoltorrentError with a hint if malformed."""
        raise NotImplementedError

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class NodeStat:
    node_id: str
    free_bytes: int
    total_bytes: int
    used_bytes: int  # bytes held in blobs
    blob_count: int
    protocol_version: int


class NodeClient:
    def __init__(self, address: NodeAddress, *, cluster_key: bytes | None = None,
                 timeout: float | None = None) -> None:
        raise NotImplementedError

    def ping(self) -> str:
        """Round trip; returns the node id."""
        raise NotImplementedError

    def stat(self) -> NodeStat:
        raise NotImplementedError

    def has(self, digests: list[str]) -> set[str]:
        """The subset of digests the node holds as complete blobs."""
        raise NotImplementedError

    def list_blobs(self) -> dict[str, int]:
        """Inventory: digest -> size in bytes."""
        raise NotImplementedError

    def put_blob(self, digest: str, prefix: bytes, src_fd: int, src_offset: int,
                 length: int) -> bool:
        """Store a blob made of `prefix` then `length` bytes of src_fd at src_offset (sendfile).

        Returns True if stored, False if the node already had it (no body sent).
        DigestMismatchError if the node hashed something else; NodeError('disk_full') etc.
        """
        raise NotImplementedError

    def get_blob_to_file(self, digest: str, out_fd: int, out_offset: int, *, skip: int = 0,
                         progress=None) -> str:
        """Stream the whole blob: the first `skip` bytes are hashed only, the rest hashed and
        pwritten at out_offset. Returns the SHA-256 hex of everything received.
        progress(nbytes) is called as data arrives, if given."""
        raise NotImplementedError

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        """Small reads (bounded by MAX_JSON_BODY_BYTES)."""
        raise NotImplementedError

    def verify(self, digests: list[str] | None = None) -> list[str]:
        """Re-hash blobs on the node (all if None); returns the digests that are bad."""
        raise NotImplementedError

    def delete(self, digest: str) -> bool:
        raise NotImplementedError

    def replicate(self, digest: str, peer: NodeAddress) -> bool:
        """Ask this node to push its copy of digest to peer; True if peer stored it, False if
        it already had it."""
        raise NotImplementedError

    def put_manifest(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def list_manifests(self) -> list[str]:
        raise NotImplementedError

    def get_manifest(self, key: str) -> bytes:
        raise NotImplementedError
