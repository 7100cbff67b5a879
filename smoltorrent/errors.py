"""The error hierarchy: one root, a subclass per thing a user can meet.

Messages are sentences that say what went wrong and what to do next; the
CLI prints them as they are.
"""


class SmoltorrentError(Exception):
    """Root of every error smoltorrent raises on purpose."""


class CheckpointFormatError(SmoltorrentError):
    """A file is not a valid .safetensors checkpoint."""


class IncompleteCheckpointError(CheckpointFormatError):
    """A file shorter than its own safetensors header says: still being written, or cut
    short (the watcher waits for it; a store refuses it)."""


class SourceChangedError(SmoltorrentError):
    """The source file changed while it was being stored."""


class NotEnoughNodesError(SmoltorrentError):
    """Fewer live nodes than the replication factor needs."""


class ProtocolError(SmoltorrentError):
    """A peer sent bytes that do not follow the wire protocol."""


class AuthenticationError(ProtocolError):
    """The cluster-key handshake failed."""


class NodeUnavailableError(SmoltorrentError):
    """A node could not be reached or stopped answering."""


class CopyBeingTrimmedError(NodeUnavailableError):
    """A node's copy of a blob is being trimmed: a transfer there sends it again later."""


class NodeError(SmoltorrentError):
    """A node answered a request with a typed error frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class DigestMismatchError(SmoltorrentError):
    """Bytes did not hash to the SHA-256 they were promised to have."""


class BadTargetError(NodeError):
    """A node stored other bytes than an unchanged source sent it: its disk, RAM or link."""

    def __init__(self, message: str) -> None:
        super().__init__("digest_mismatch", message)


class GatherError(SmoltorrentError):
    """A checkpoint could not be rebuilt byte for byte."""


class MetadataError(SmoltorrentError):
    """The metadata store (Redis) is unreachable or holds something unexpected."""


class NotFoundError(SmoltorrentError):
    """A checkpoint, version, node or dead letter that does not exist."""


class UnsupportedVersionError(ProtocolError):
    """A peer speaks another version of the wire protocol."""


class FrameTooLargeError(ProtocolError):
    """A frame declares more bytes than the protocol allows for it."""


class DiskFullError(SmoltorrentError):
    """A node has no room left for a blob."""


class DiskIOError(SmoltorrentError):
    """A node's disk failed a write or a sync (EIO and the like): not the data's fault and
    not space; the copy can go to another node, and the disk wants checking."""


class PeerClosedError(ProtocolError):
    """A peer closed the connection in the middle of a frame or before answering."""


class InsufficientSpaceError(SmoltorrentError):
    """The live nodes lack the free space to hold every replica of every shard."""


class ManifestError(SmoltorrentError):
    """A manifest is malformed or written in a schema this version does not know."""


class StateDictError(SmoltorrentError):
    """A state dict cannot be written or read as safetensors (not tensors, mixed, bad dtype)."""


class DestinationNotAllowedError(SmoltorrentError):
    """A gather was asked to write outside the directories its worker allows."""


class UnsafeNameError(SmoltorrentError):
    """A name from the network, a broker message, Redis or a node's manifest that would
    become a path outside the directory it belongs in (a '/', '..', a key not hex)."""


class ConfigError(SmoltorrentError):
    """A setting (a flag or an environment variable) has a value smoltorrent cannot use."""


class UsageError(SmoltorrentError):
    """A command's arguments do not fit together."""


class OutcomeUnknownError(SmoltorrentError):
    """Redis stayed unreachable while waiting on an operation that was already recorded:
    it may still complete (the CLI exits 3, not 1, so a script does not retry a success)."""


class ManifestNotDurableError(SmoltorrentError):
    """A commit could not put the manifest on every holder (at least min(R, live nodes))."""


class ShardedCheckpointError(SmoltorrentError):
    """A per-rank sharded checkpoint step cannot be saved or resumed as asked."""


class StepNotFoundError(ShardedCheckpointError, NotFoundError):
    """No such step of a sharded checkpoint (never saved, or removed by keep-last-K)."""


class WorldSizeMismatchError(ShardedCheckpointError):
    """A step was saved with another world size than the one saving or resuming it."""


class PartialStepError(ShardedCheckpointError):
    """A step not every rank has finished storing: it is not committed, never resumed from."""


class MissingRankError(ShardedCheckpointError):
    """A committed step lacks a rank's part (removed, or its version is not committed)."""


class ChunkFormatError(SmoltorrentError):
    """An encoded chunk is corrupt or in a format this version cannot decode."""
