"""A training run's nested state as safetensors: tensors under key paths, the rest as JSON.

    {"model": {"layers.0.weight": w}, "optim": {"state": {0: {"exp_avg": m}},
     "param_groups": [{"lr": 0.1, "params": [0]}]}, "step": 3}

is written as the tensors "model/layers.0.weight" and "optim/state/0/exp_avg", and the
header metadata key "smoltorrent.state" holding the structure: every dict (its key
order, int keys apart from str keys, OrderedDict apart from dict), list, tuple and
plain value (int, float, bool, str, None), with each tensor leaf naming its tensor.
Nothing is pickled and nothing runs on load: the structure is plain JSON.

A key path joins a leaf's keys with "/", so torch's dotted module names read as they
are and a glob on "model/*" or "model/layers.0.*" selects what it says. A key path is
reversible (decode(encode(p)) == p) for any keys: inside a str key "%" and "/" are
escaped as %25 and %2F, and a str key that reads as an int ("0", "-1") has its first
character escaped too, so the optimizer's int key 0 ("0") and a str key "0" ("%30")
stay apart. List and tuple items are keyed by their index.

torch and numpy mix: a numpy array in a torch state (numpy's RNG state,
np.random.get_state(), beside torch's) is written as the other tensors are, from its
own memory, and its leaf says {"as": "numpy"}: it loads back as a numpy array of the
same dtype and bits (framework="torch"; with framework="numpy" every leaf is numpy).
A tensor spread over ranks (DTensor, ShardedTensor) is refused, pointing to
smoltorrent.dcp.

A flat state dict (str keys, tensor values, none tied) keeps the layout it always had:
each key is its tensor's name, no structure is written, and it loads as a dict. Tensors
that are one tensor under several paths (tied weights) are stored once, and every path
gets back the same tensor object.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from smoltorrent.errors import StateDictError
from smoltorrent.tensors import kind_of

STATE_KEY = "smoltorrent.state"  # header metadata key holding the structure
FORMAT = 1  # of the structure's JSON; a reader refuses a newer one
SEPARATOR = "/"

Key = int | str
Path = tuple[Key, ...]

AS = "as"  # a tensor leaf's key naming the framework it loads back as, when not the state's

# Tensors spread over ranks (torch.distributed): refused with where to save them instead.
_DISTRIBUTED = frozenset({"DTensor", "ShardedTensor"})

_INT_LIKE = re.compile(r"-?[0-9]+")
_ESCAPED = re.compile(r"%([0-9A-F]{2})")
_PLAIN = (bool, int, float, str)


def encode(path: Sequence[Key]) -> str:
    """The key path of the leaf reached by `path` (keys and list indices, outermost first)."""
    return SEPARATOR.join(_segment(key) for key in path)


def _segment(key: Key) -> str:
    if type(key) is int:
        return str(key)
    text = key.replace("%", "%25").replace(SEPARATOR, "%2F")
    if _INT_LIKE.fullmatch(text):
        text = f"%{ord(text[0]):02X}{text[1:]}"
    return text


def decode(name: str) -> Path:
    """The keys a key path was made of: the inverse of encode."""
    return tuple(
        int(s) if _INT_LIKE.fullmatch(s) else _ESCAPED.sub(lambda m: chr(int(m[1], 16)), s)
        for s in name.split(SEPARATOR)
    )


@dataclass(frozen=True)
class Flat:
    """A state as safetensors holds it: tensors by name, and the structure (None when the
    state is a flat state dict, written as it always was)."""

    tensors: dict[str, Any]
    structure: str | None
    framework: str


def flatten(state: Mapping[str, Any]) -> Flat:
    """Tensors under their key paths and the structure as JSON; StateDictError for a value
    that is neither a tensor, a container nor a plain value, or a mix of frameworks."""
    if not isinstance(state, Mapping):
        raise StateDictError(
            "a state to save must be a mapping (a state dict, or a dict of them), not "
            f"{type(state).__name__}"
        )
    tensors: dict[str, Any] = {}
    names_by_identity: dict[tuple, str] = {}
    kinds: set[str] = set()
    leaves: dict[str, dict[str, Any]] = {}  # a tensor's name -> its leaf(s) in the tree
    tied = False

    def node(value: Any, path: Path) -> Any:
        nonlocal tied
        kind = kind_of(value)
        if kind is not None:
            kinds.add(kind)
            identity = _identity(value, kind)
            if identity is not None and identity in names_by_identity:
                tied = True
                return leaves[names_by_identity[identity]]
            name = encode(path)
            tensors[name] = value
            if identity is not None:
                names_by_identity[identity] = name
            leaves[name] = {"tensor": name}
            return leaves[name]
        if value is None or isinstance(value, _PLAIN):
            return _plain(value)
        if isinstance(value, Mapping):
            items = []
            for key, item in value.items():
                if type(key) is not int and not isinstance(key, str):
                    raise StateDictError(
                        f"{_where(path)} has the key {key!r}, a {type(key).__name__}; keys "
                        "must be str or int (convert it, e.g. str(key))"
                    )
                items.append([key if type(key) is int else str(key), node(item, (*path, key))])
            return {"odict" if isinstance(value, OrderedDict) else "dict": items}
        if isinstance(value, (list, tuple)):
            tag = "tuple" if isinstance(value, tuple) else "list"
            return {tag: [node(item, (*path, i)) for i, item in enumerate(value)]}
        if type(value).__name__ in _DISTRIBUTED:
            raise StateDictError(
                f"{_where(path)} is a {type(value).__name__}, a tensor spread over ranks: "
                "save such a state with torch.distributed.checkpoint through smoltorrent.dcp "
                "(dcp.save(state, storage_writer=smoltorrent.dcp.Writer(name))), which "
                "reshards it on load; or save this rank's local tensor (.to_local()) with "
                "save_sharded(partitions=...)"
            )
        raise StateDictError(
            f"{_where(path)} is a {type(value).__module__}.{type(value).__name__}: a saved "
            "state holds torch tensors, numpy arrays or MLX arrays, dicts, lists and tuples "
            "of them, and plain values (int, float, bool, str, None); convert it to one"
        )

    tree = node(state, ())
    mixed = kinds == {"torch", "numpy"}
    if len(kinds) > 1 and not mixed:
        raise StateDictError(
            f"the state mixes {' and '.join(sorted(kinds))} tensors; convert them to one "
            "framework before saving (torch and numpy mix: numpy's RNG state in a torch "
            "state is saved as it is)"
        )
    framework = "torch" if mixed else kinds.pop() if kinds else "numpy"
    if mixed:
        for name, value in tensors.items():
            if kind_of(value) == "numpy":
                tensors[name] = _as_torch(value, name)
                leaves[name][AS] = "numpy"
    flat = (
        not tied
        and not mixed
        and all(isinstance(k, str) and kind_of(v) is not None for k, v in state.items())
    )
    if flat:
        return Flat(dict(state.items()), None, framework)
    structure = json.dumps({"format": FORMAT, "tree": tree}, separators=(",", ":"))
    return Flat(tensors, structure, framework)


def _as_torch(array: Any, name: str) -> Any:
    """A numpy array of a torch state as a torch tensor on its memory (no copy), written
    like the state's other tensors; its leaf says it loads back as numpy."""
    import warnings

    import numpy as np
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only array: the save only reads it
            return torch.from_numpy(array)
    except (TypeError, ValueError):
        pass
    try:
        return torch.from_numpy(np.ascontiguousarray(array))  # negative strides
    except (TypeError, ValueError) as exc:
        raise StateDictError(
            f"the numpy array at {name!r} ({array.dtype}) cannot be saved beside torch "
            f"tensors: {exc}; convert it to a torch tensor or save it apart"
        ) from None


def _plain(value: Any) -> Any:
    # Subclasses (an IntEnum, numpy's float64) are written as the plain type they extend.
    for kind in _PLAIN:
        if isinstance(value, kind):
            return kind(value)
    return None


def _where(path: Path) -> str:
    return f"the value at {encode(path)!r}" if path else "the state"


def _identity(value: Any, kind: str) -> tuple | None:
    """What makes two leaves one tensor: the same memory seen the same way. None for a
    tensor with no memory to share (empty, or on the meta device)."""
    if kind == "torch":
        if value.device.type == "meta" or value.numel() == 0:
            return None
        storage = value.untyped_storage()
        return (
            str(value.device),
            storage.data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
        )
    if kind == "numpy":
        if value.size == 0:
            return None
        pointer = value.__array_interface__["data"][0]
        return (pointer, value.shape, value.strides, value.dtype)
    return ("mlx", id(value))  # MLX shows no memory address: one array object is one tensor


def parse_structure(metadata: Mapping[str, str] | None) -> dict | None:
    """The structure a header's metadata holds, or None for a flat state dict."""
    if not metadata or STATE_KEY not in metadata:
        return None
    try:
        structure = json.loads(metadata[STATE_KEY])
        version = structure["format"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StateDictError(f"the checkpoint's {STATE_KEY} metadata is not valid: {exc}") from None
    if version > FORMAT:
        raise StateDictError(
            f"the checkpoint's state was written in format {version}, newer than this "
            f"smoltorrent reads ({FORMAT}); upgrade smoltorrent to load it"
        )
    return structure["tree"]


def paths(tree: Any) -> Iterator[tuple[str, bool, str | None]]:
    """Every path below the root: (key path, is a container, its tensor's name or None)."""

    def walk(node: Any, path: Path) -> Iterator[tuple[str, bool, str | None]]:
        for key, child in _children(node):
            here = (*path, key)
            container = _children(child) is not None
            tensor = child.get("tensor") if isinstance(child, dict) else None
            yield encode(here), container, tensor
            if container:
                yield from walk(child, here)

    yield from walk(tree, ())


def _children(node: Any) -> list[tuple[Key, Any]] | None:
    if not isinstance(node, dict):
        return None
    for tag in ("dict", "odict"):
        if tag in node:
            return [(key, child) for key, child in node[tag]]
    for tag in ("list", "tuple"):
        if tag in node:
            return list(enumerate(node[tag]))
    return None


def unflatten(tree: Any, tensors: Mapping[str, Any], chosen: set[str] | None = None) -> Any:
    """The state the structure describes, its tensor leaves from `tensors`. With `chosen`
    (key paths), only what they select: a chosen container whole, a chosen leaf, and the
    containers leading to them."""

    def build(node: Any, path: Path, whole: bool) -> tuple[bool, Any]:
        if isinstance(node, dict) and "tensor" in node:
            value = tensors.get(node["tensor"])
            if node.get(AS) == "numpy" and kind_of(value) == "torch":
                value = value.detach().cpu().numpy()  # saved as numpy: numpy again
            return (whole or encode(path) in chosen, value)
        children = _children(node)
        if children is None:
            return (whole or encode(path) in chosen, node)
        whole = whole or (bool(path) and encode(path) in chosen)
        kept = []
        for key, child in children:
            keep, value = build(child, (*path, key), whole)
            if keep:
                kept.append((key, value))
        if "list" in node or "tuple" in node:
            values = [value for _, value in kept]
            built: Any = tuple(values) if "tuple" in node else values
        else:
            built = (OrderedDict if "odict" in node else dict)(kept)
        return (whole or bool(kept), built)

    if chosen is None:
        chosen = set()
        return build(tree, (), True)[1]
    return build(tree, (), False)[1]
