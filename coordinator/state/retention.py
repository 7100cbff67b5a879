"""Retention per prefix: the rules (`smoltorrent retain PREFIX/ --keep K`) and which
versions a rule lets go.

The last K per name never prunes a run that saves each step under a name of its own
(`run1/step_100.safetensors`, `run1/step_200.safetensors`, ...): every name has one
version. A rule on `run1/` keeps the K newest *entries* directly under it, an entry being a
name (`run1/step_100.safetensors`) or a folder of names (`run1/step_100/`, kept or let go
whole), ordered by the latest request of any of their names (the request counter, never a
clock). Every version of an older entry goes, its current one too, unless pinned, being
gathered or still pending (md.removals.retire checks again, atomically). Left alone: a
directory checkpoint and the ranks of a sharded one, whose records bind their files
together (`rm` removes the first whole; `save_sharded(keep=)` prunes the second).
"""

from __future__ import annotations

import re

from coordinator.plan.directory import RECORD_FILE
from coordinator.state import redis_keys as K
from coordinator.state.metadata import Metadata
from smoltorrent.errors import UsageError

_SHARDED_RANK = re.compile(r"/step-\d{8}/rank-\d{5}-of-\d{5}\.safetensors$")


def rules(md: Metadata) -> dict[str, int]:
    """prefix -> K, every rule set."""
    return {prefix: int(keep) for prefix, keep in sorted(md.r.hgetall(K.RETAIN).items())}


def set_rule(md: Metadata, prefix: str, keep: int) -> None:
    check_prefix(prefix)
    if keep < 1:
        raise UsageError(f"--keep {keep}: keep at least 1 (the newest entry always stays)")
    md.r.hset(K.RETAIN, prefix, keep)


def drop_rule(md: Metadata, prefix: str) -> bool:
    return bool(md.r.hdel(K.RETAIN, prefix))


def check_prefix(prefix: str) -> None:
    if not prefix.endswith("/") or prefix == "/":
        raise UsageError(
            f"{prefix!r} is not a prefix: give the folder of names it covers, ending in /"
            " (e.g. run1/)"
        )


def entry_of(prefix: str, name: str) -> str:
    """The entry under `prefix` that `name` belongs to: itself, or its first folder."""
    head, slash, _ = name[len(prefix) :].partition("/")
    return prefix + head + slash


def plan(md: Metadata, prefix: str, keep: int) -> tuple[list[str], int | None]:
    """(the names under `prefix` that its rule lets go, oldest entry first; the request
    number every request of theirs precedes, which md.removals.retire checks again), or
    ([], None) when there are K entries or fewer."""
    every = set(md.versions.names())
    names = sorted(n for n in every if n.startswith(prefix))
    parts = prefix.split("/")[:-1]
    folders = ["/".join(parts[: i + 1]) + "/" for i in range(len(parts))]
    if any(f + RECORD_FILE in every for f in folders):
        return [], None  # inside a directory checkpoint: its record binds its files
    with md.r.pipeline(transaction=False) as p:
        for n in names:
            p.zrevrange(K.VERSIONS.format(name=n), 0, 0, withscores=True)
        latest = p.execute()
    entries: dict[str, list[str]] = {}
    newest: dict[str, float] = {}
    bound: set[str] = set()
    for n, top in zip(names, latest, strict=True):
        if not top:
            continue
        entry = entry_of(prefix, n)
        entries.setdefault(entry, []).append(n)
        newest[entry] = max(newest.get(entry, 0.0), top[0][1])
        if n.rpartition("/")[2] == RECORD_FILE or _SHARDED_RANK.search(n):
            bound.add(entry)
    order = sorted(newest, key=newest.__getitem__, reverse=True)
    if len(order) <= keep:
        return [], None
    before = int(newest[order[keep - 1]])  # the latest request of the oldest entry kept
    going = [n for e in reversed(order[keep:]) if e not in bound for n in sorted(entries[e])]
    return going, before
