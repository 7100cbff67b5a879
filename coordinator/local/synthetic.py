"""Synthetic LLM-shaped checkpoints, written without any tensor library.

Valid .safetensors files (any bytes are valid BF16/F32 values), for the
demo and the benchmarks; written in fixed chunks so memory stays flat.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

from coordinator.plan.manifest import Manifest
from coordinator.plan.manifest_entries import ShardEntry
from smoltorrent import defaults

_ITEM = {"BF16": 2, "F32": 4}


def llm_layout(target_bytes: int, hidden: int = 1024) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of a decoder stack sized to about target_bytes."""
    vocab = 8 * hidden
    tensors = [("model.embed_tokens.weight", "BF16", [vocab, hidden])]
    per_layer = [
        ("self_attn.q_proj.weight", [hidden, hidden]),
        ("self_attn.k_proj.weight", [hidden // 4, hidden]),
        ("self_attn.v_proj.weight", [hidden // 4, hidden]),
        ("self_attn.o_proj.weight", [hidden, hidden]),
        ("mlp.gate_proj.weight", [3 * hidden, hidden]),
        ("mlp.up_proj.weight", [3 * hidden, hidden]),
        ("mlp.down_proj.weight", [hidden, 3 * hidden]),
    ]
    layer_bytes = sum(a * b for _, (a, b) in per_layer) * 2 + 2 * hidden * 4
    fixed = 2 * vocab * hidden * 2 + hidden * 4
    layers = max(1, (target_bytes - fixed) // layer_bytes)
    for i in range(layers):
        for name, shape in per_layer:
            tensors.append((f"model.layers.{i}.{name}", "BF16", shape))
        tensors.append((f"model.layers.{i}.input_layernorm.weight", "F32", [hidden]))
        tensors.append((f"model.layers.{i}.post_attention_layernorm.weight", "F32", [hidden]))
    tensors.append(("model.norm.weight", "F32", [hidden]))
    tensors.append(("lm_head.weight", "BF16", [vocab, hidden]))
    return tensors


def write_checkpoint(path: str | os.PathLike, target_bytes: int, hidden: int = 1024) -> int:
    """Write an LLM-like checkpoint of about target_bytes; returns its size."""
    header: dict = {"__metadata__": {"format": "pt", "source": "smoltorrent synthetic"}}
    offset = 0
    layout = llm_layout(target_bytes, hidden)
    for name, dtype, shape in layout:
        size = _ITEM[dtype] * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        remaining = offset
        while remaining:
            n = min(remaining, defaults.IO_CHUNK_BYTES)
            f.write(os.urandom(n))
            remaining -= n
    return 8 + len(raw) + offset


def write_sparse_checkpoint(path: str | os.PathLike, tensor_bytes: int) -> int:
    """Write a checkpoint of one U8 tensor of tensor_bytes (plus a 16-byte one after it),
    cheaply: the file is sparse (reads as zeros) except 1 MiB of random bytes at its start,
    around each 2^31 and 2^32 boundary of the file and at its end, so bytes moved to the
    wrong offset show. Returns its size. For shards past 4 GiB in little time and disk."""
    header = {
        "big": {"dtype": "U8", "shape": [tensor_bytes], "data_offsets": [0, tensor_bytes]},
        "small": {
            "dtype": "U8",
            "shape": [16],
            "data_offsets": [tensor_bytes, tensor_bytes + 16],
        },
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    size = 8 + len(raw) + tensor_bytes + 16
    marked = 1 << 20
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(size)
        spots = [8 + len(raw), size - marked]
        spots += [b - marked // 2 for b in (1 << 31, 1 << 32) if b + marked // 2 < size - marked]
        for at in spots:
            f.seek(max(at, 8 + len(raw)))
            f.write(os.urandom(marked))
    return size


def synthetic_manifest(name: str, index: int, shards: int = 2, replicas: int = 2) -> Manifest:
    """A valid manifest with made-up blob digests and no file behind it, for recording many
    versions straight into the metadata (listing tests and benchmarks). Version `index` of
    `name` has 1 + index % 3 ten-byte tensors per shard."""
    per_shard, tensor_bytes = 1 + index % 3, 10
    names = [[f"t{s}.{k}" for k in range(per_shard)] for s in range(shards)]
    layout, offset = {}, 0
    for tensor in (t for shard in names for t in shard):
        layout[tensor] = {
            "dtype": "U8",
            "shape": [tensor_bytes],
            "data_offsets": [offset, offset + tensor_bytes],
        }
        offset += tensor_bytes
    header = json.dumps(layout).encode()
    shard_bytes = per_shard * tensor_bytes

    def digest(*parts) -> str:
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    return Manifest(
        name=name,
        version_id=digest("version", name, index),
        source_size=8 + len(header) + offset,
        header_bytes=header,
        replicas=replicas,
        shards=tuple(
            ShardEntry(
                index=s,
                data_start=s * shard_bytes,
                data_end=(s + 1) * shard_bytes,
                tensors=tuple(names[s]),
                blob_size=shard_bytes + 100,
                blob_sha256=digest("blob", name, index, s),
                blob_data_offset=100,
            )
            for s in range(shards)
        ),
        created_at=1_700_000_000.0 + index,
    )
