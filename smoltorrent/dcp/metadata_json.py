"""DCP's checkpoint Metadata as JSON and back, with no pickle: what DCP's own
FileSystemWriter pickles into `.metadata`, smoltorrent keeps as a JSON string in the
header metadata of the step's rank-0 part.

What it holds: per state-dict key, a tensor's dtype, size and chunks (offsets, sizes)
or a marker that the key is BYTE_IO; the planner's data (DefaultSavePlanner: each flat
key's path in the nested state, tuples of str and int); the storage's data (ours: which
rank's part holds each item, under which tensor name); StorageMeta; the version. A
planner whose data is not plain JSON values and tuples is refused with its path named,
rather than pickled.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from smoltorrent.errors import CheckpointFormatError

SCHEMA = 1  # this module's JSON layout; a reader refuses one it does not know
_TUPLE = "__tuple__"  # a tuple, kept apart from a list (the planner's key paths are tuples)


def dumps(metadata: Metadata) -> str:
    """The Metadata as a JSON string."""
    storage = metadata.storage_data
    if storage is not None and not isinstance(storage, dict):
        raise CheckpointFormatError(
            f"DCP metadata's storage_data is a {type(storage).__name__}; smoltorrent's Writer "
            "writes a dict of MetadataIndex to its items"
        )
    return json.dumps(
        {
            "schema": SCHEMA,
            "version": metadata.version,
            "state_dict_metadata": {
                fqn: _storage_type(fqn, value)
                for fqn, value in metadata.state_dict_metadata.items()
            },
            "planner_data": _plain(metadata.planner_data, "planner_data"),
            "storage_data": None
            if storage is None
            else [
                [index.fqn, _size(index.offset), _plain(data, f"storage_data[{index.fqn!r}]")]
                for index, data in storage.items()
            ],
            "storage_meta": _storage_meta(metadata.storage_meta),
        },
        sort_keys=True,
    )


def loads(text: str) -> Metadata:
    """The Metadata dumps() wrote."""
    raw = json.loads(text)
    if raw.get("schema") != SCHEMA:
        raise CheckpointFormatError(
            f"DCP metadata in schema {raw.get('schema')!r}; this smoltorrent reads schema "
            f"{SCHEMA}: upgrade smoltorrent to load this checkpoint"
        )
    storage = raw["storage_data"]
    return Metadata(
        state_dict_metadata={
            fqn: _from_storage_type(value) for fqn, value in raw["state_dict_metadata"].items()
        },
        planner_data=_unplain(raw["planner_data"]),
        storage_data=None
        if storage is None
        else {
            MetadataIndex(fqn, None if offset is None else torch.Size(offset)): _unplain(data)
            for fqn, offset, data in storage
        },
        storage_meta=None if raw["storage_meta"] is None else StorageMeta(**raw["storage_meta"]),
        version=raw["version"],
    )


def _storage_type(fqn: str, value: Any) -> dict[str, Any]:
    if isinstance(value, BytesStorageMetadata):
        return {"type": "bytes"}
    if not isinstance(value, TensorStorageMetadata):
        raise CheckpointFormatError(
            f"DCP metadata of {fqn!r} is a {type(value).__name__}, neither tensor nor bytes"
        )
    p = value.properties
    return {
        "type": "tensor",
        "dtype": _torch_name(p.dtype),
        "layout": _torch_name(p.layout),
        "requires_grad": p.requires_grad,
        "memory_format": _torch_name(p.memory_format),
        "pin_memory": p.pin_memory,
        "size": list(value.size),
        "chunks": [[list(c.offsets), list(c.sizes)] for c in value.chunks],
    }


def _from_storage_type(raw: dict[str, Any]) -> TensorStorageMetadata | BytesStorageMetadata:
    if raw["type"] == "bytes":
        return BytesStorageMetadata()
    return TensorStorageMetadata(
        properties=TensorProperties(
            dtype=_torch_attr(raw["dtype"], torch.dtype),
            layout=_torch_attr(raw["layout"], torch.layout),
            requires_grad=raw["requires_grad"],
            memory_format=_torch_attr(raw["memory_format"], torch.memory_format),
            pin_memory=raw["pin_memory"],
        ),
        size=torch.Size(raw["size"]),
        chunks=[
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
            for o, s in raw["chunks"]
        ],
    )


def _torch_name(value: Any) -> str:
    """torch.float32 -> "float32", torch.strided -> "strided": names torch resolves again."""
    return str(value).removeprefix("torch.")


def _torch_attr(name: str, kind: type) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise CheckpointFormatError(f"DCP metadata names {name!r}, which is no torch {kind}")
    return value


def _size(offset: torch.Size | None) -> list[int] | None:
    return None if offset is None else list(offset)


def _storage_meta(meta: StorageMeta | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    checkpoint_id = meta.checkpoint_id
    return {
        "checkpoint_id": None if checkpoint_id is None else os.fspath(checkpoint_id),
        "save_id": meta.save_id,
        "load_id": meta.load_id,
        "modules": list(meta.modules),
    }


def _plain(value: Any, where: str) -> Any:
    """JSON values, with tuples tagged so they come back as tuples."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_plain(v, where) for v in value]}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value) and _TUPLE not in value:
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise CheckpointFormatError(
        f"DCP metadata's {where} holds a {type(value).__name__}, which smoltorrent keeps only "
        "as JSON (str, int, float, bool, None, lists, tuples, dicts with str keys); "
        "smoltorrent never pickles it. Use DCP's default planner, or one whose data is plain."
    )


def _unplain(value: Any) -> Any:
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TUPLE}:
            return tuple(_unplain(v) for v in value[_TUPLE])
        return {k: _unplain(v) for k, v in value.items()}
    return value
