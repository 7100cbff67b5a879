"""What a transfer sends of one shard's blob: its span of the source (BlobSpan), read from
Redis for that shard alone; and each shard's blob header, rebuilt from the manifest.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.plan.manifest import Manifest
from coordinator.plan.manifest_checks import checked_count, checked_fields, checked_sha256, fail
from coordinator.plan.planner import blob_prefix
from coordinator.plan.safetensors_header import LENGTH_PREFIX_BYTES


def blob_prefixes(manifest: Manifest) -> tuple[bytes, ...]:
    """Each shard's blob header, rebuilt from the manifest alone."""
    header = manifest.header()
    by_name = {tensor.name: tensor for tensor in header.tensors}
    return tuple(
        blob_prefix([by_name[name] for name in shard.tensors]) for shard in manifest.shards
    )


@dataclass(frozen=True, slots=True)
class BlobSpan:
    """What sending one shard's blob from its source takes, and nothing more: its digest and
    size, its own header (prefix) and the byte range of the source after it. A transfer task
    reads this for its shard alone, not the whole manifest (megabytes for thousands of
    tensors), so its memory follows its shard, not the checkpoint."""

    index: int
    digest: str
    size: int
    prefix: bytes
    offset: int  # in the source file
    length: int
    # An encoded chunk (coordinator/dataplane/codec.py): the blob is the encoding of the
    # source range, not prefix + range, kept at this path of the source's host once the
    # store encoded it ("": not kept, encode it again). None: the blob is prefix + range.
    spool: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "index": self.index,
                "digest": self.digest,
                "size": self.size,
                "prefix": base64.b64encode(self.prefix).decode("ascii"),
                "offset": self.offset,
                "length": self.length,
            }
            | ({} if self.spool is None else {"spool": self.spool}),
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> BlobSpan:
        try:
            document = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            fail(f"a blob span is not JSON ({error})")
        given = document.keys() if isinstance(document, dict) else set()
        fields = checked_fields(
            document,
            {"index", "digest", "size", "prefix", "offset", "length"} | ({"spool"} & given),
            "a span",
        )
        spool = fields.get("spool")
        if spool is not None and not isinstance(spool, str):
            fail(f"a blob span's spool is {spool!r}, not a path")
        try:
            prefix = base64.b64decode(fields["prefix"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            fail("a blob span's prefix is not base64")
        span = cls(
            index=checked_count(fields, "index", "a span"),
            digest=checked_sha256(fields, "digest", "a span"),
            size=checked_count(fields, "size", "a span"),
            prefix=prefix,
            offset=checked_count(fields, "offset", "a span", LENGTH_PREFIX_BYTES),
            length=checked_count(fields, "length", "a span"),
            spool=spool,
        )
        if span.spool is None and span.size != len(span.prefix) + span.length:
            fail(f"blob span {span.index}: size {span.size} is not its prefix plus its range")
        return span


def blob_spans(manifest: Manifest, prefixes: Sequence[bytes] | None = None) -> tuple[BlobSpan, ...]:
    """Every shard's span; `prefixes` when the caller has them (rebuilt from the manifest's
    header otherwise)."""
    prefixes = blob_prefixes(manifest) if prefixes is None else prefixes
    return tuple(
        BlobSpan(
            index=shard.index,
            digest=shard.blob_sha256,
            size=shard.blob_size,
            prefix=prefix,
            offset=manifest.data_start + shard.data_start,
            length=shard.data_end - shard.data_start,
        )
        for shard, prefix in zip(manifest.shards, prefixes, strict=True)
    )
