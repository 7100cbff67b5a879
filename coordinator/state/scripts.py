"""The Lua scripts of the metadata rooms: one file a script under coordinator/state/lua/,
read once and registered once per Redis client.

Each file opens with a header (BullMQ's src/commands style) naming every key and
argument it takes, one a line, as `KEYS[i] SPEC: what it is` or `ARGV[i] name: ...`:
a key's SPEC names its template in redis_keys.py (`A|B` for either); `KEYS[i..]` and
`ARGV[i..]` take the rest, a key pattern such as `(BLOB_REFS, BLOB_DELETING)*`.
A script reads and writes only the keys its caller passes; it builds none itself, so
the header is the whole list of what it touches (tests/coordinator/state/test_scripts.py
checks every caller against it). A line `--- @include "name"` is replaced by
lua/includes/name.lua when the script is read.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import redis

from smoltorrent.errors import MetadataError

LUA = Path(__file__).parent / "lua"
_INCLUDE = re.compile(r'^--- @include "([a-z_]+)"$', re.M)
_SLOT = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)(\.\.)?\]\s+([^:]+):", re.M)


@dataclass(frozen=True)
class Header:
    """What a script's header declares: its keys' specs and its arguments' names, in
    order; a spec ending the list with `..` takes any number more."""

    keys: tuple[str, ...]
    args: tuple[str, ...]
    more_keys: bool
    more_args: bool

    def takes(self, nkeys: int, nargs: int) -> bool:
        """Whether a call with this many keys and arguments fits the header."""
        fixed_keys = len(self.keys) - self.more_keys
        fixed_args = len(self.args) - self.more_args
        return (nkeys >= fixed_keys if self.more_keys else nkeys == fixed_keys) and (
            nargs >= fixed_args if self.more_args else nargs == fixed_args
        )


@cache
def header(name: str) -> Header:
    """The header of lua/<name>.lua (MetadataError if its slots are not 1, 2, 3, ...)."""
    text = (LUA / f"{name}.lua").read_text()
    opening = text.split("]]", 1)[0]
    found: dict[str, list[tuple[int, bool, str]]] = {"KEYS": [], "ARGV": []}
    for kind, index, more, spec in _SLOT.findall(opening):
        found[kind].append((int(index), bool(more), spec.strip()))
    for kind, slots in found.items():
        if [i for i, _, _ in slots] != list(range(1, len(slots) + 1)) or any(
            more for _, more, _ in slots[:-1]
        ):
            raise MetadataError(f"lua/{name}.lua: its {kind} are not numbered 1, 2, ... in order")
    return Header(
        keys=tuple(s for _, _, s in found["KEYS"]),
        args=tuple(s for _, _, s in found["ARGV"]),
        more_keys=bool(found["KEYS"]) and found["KEYS"][-1][1],
        more_args=bool(found["ARGV"]) and found["ARGV"][-1][1],
    )


@cache
def source(name: str) -> str:
    """The text of lua/<name>.lua with its includes joined in."""
    text = (LUA / f"{name}.lua").read_text()
    return _INCLUDE.sub(lambda m: (LUA / "includes" / f"{m[1]}.lua").read_text(), text)


class Script:
    """One script registered on a client; a call whose number of keys or arguments its
    header does not take is refused before it reaches Redis."""

    def __init__(self, r: redis.Redis, name: str) -> None:
        self.name = name
        self.header = header(name)
        self._script = r.register_script(source(name))

    def __call__(
        self, keys: Sequence, args: Sequence = (), client: redis.client.Pipeline | None = None
    ):
        self._check(keys, args)
        return self._script(keys=keys, args=args, client=client)

    def queue_loaded(self, p: redis.client.Pipeline, keys: Sequence, args: Sequence) -> None:
        """Queue a call on `p` of a script this client ran already, without the SCRIPT EXISTS
        round trip a pipeline sends first for scripts (NoScriptError from p.execute() if the
        server has lost it since: call it the usual way then)."""
        self._check(keys, args)
        p.evalsha(self._script.sha, len(keys), *keys, *args)

    def _check(self, keys: Sequence, args: Sequence) -> None:
        if not self.header.takes(len(keys), len(args)):
            raise MetadataError(
                f"lua/{self.name}.lua called with {len(keys)} keys and {len(args)} arguments;"
                " its header takes others"
            )


_loaded: weakref.WeakKeyDictionary[redis.Redis, dict[str, Script]] = weakref.WeakKeyDictionary()


def load(r: redis.Redis, name: str) -> Script:
    """The script lua/<name>.lua (e.g. "versions/commit") registered on `r`, once per client."""
    scripts = _loaded.setdefault(r, {})
    if name not in scripts:
        scripts[name] = Script(r, name)
    return scripts[name]
