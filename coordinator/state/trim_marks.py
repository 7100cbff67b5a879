"""The mark a trim puts on the one copy it is deleting, so no store counts that copy.

A trim (coordinator/state/healing.py trim_blob) deletes a surplus copy in three steps:
  M  one script: count again the copies the blob needs (the most any version using it
     asks for, pending ones included, and the sweep's R) against its holders on up nodes;
     only if this copy is still surplus, mark it (TRIM_MARK, expiring) and take the node
     out of the placement;
  D  the node deletes its copy;
  C  the trim clears the mark.
Every transfer and chain task checks the mark of its target before sending (waits while
it stands), and the commit barrier (lua/versions/settle.lua) refuses to count a replica on a
marked copy. Why no order of a store S (its version V) against M, D, C leaves V short:
- V created before M: M counts V's R, and marks only if the copies left without this one
  are at least that many, so V is at R without it. A task of V that read the placement
  with this node (before M) and settles it without sending ("held") is refused unless the
  node is still in the placement: after M it is not, so the task retries and sends the
  blob again (below). A settle during the mark is refused whatever the path.
- V created after M: its tasks read the placement after M, without this node, so they
  send the blob there. Their check before sending sees the mark (M < check < C: they wait
  and try again) or comes after C > D: the put then reaches the node after its delete and
  stores a fresh copy. A put never reaches the node before D unless it was checked before
  M (so its version was created before M, counted above), and its settle during the mark
  is refused.
- A put that reached the node before D with its settle after C (a task of a version
  created before M, whose target was added to the placement by someone else between its
  read and M) is the one order left: V has its R without that copy (M counted it), the
  placement lists one copy too many until the crosscheck finds it missing.
"""

from __future__ import annotations

from collections.abc import Iterable

from coordinator.state import redis_keys as K
from coordinator.state.metadata import Metadata
from coordinator.state.nodes import marked_unreachable, unreachable_keys
from coordinator.state.scripts import load
from smoltorrent import defaults
from smoltorrent.errors import MetadataError


def mark(md: Metadata, digest: str, node_id: str, replicas: int, up: Iterable[str]) -> int:
    """Step M (module doc, lua/trim_marks/mark.lua): 1 if `node_id`'s copy is marked and out
    of the placement, 0 if it is no longer surplus (keep it), -1 if the node no longer holds
    it. The script reads the hash and manifest of every version using the blob: they are
    read here first, and again if one started using it in between."""
    script, up = load(md.r, "trim_marks/mark"), list(up)
    for _ in range(defaults.SCRIPT_KEY_RETRIES):
        users = sorted(md.blobs.blob_refs(digest))
        keys = [
            K.PLACEMENT.format(digest=digest),
            K.BLOB_REFS.format(digest=digest),
            K.TRIM_MARK.format(digest=digest, node_id=node_id),
            K.PLACEMENTS_LISTED,
        ]
        for vkey in users:
            keys += [K.VERSION.format(vkey=vkey), K.MANIFEST.format(vkey=vkey)]
        args = [node_id, replicas, defaults.TRIM_MARK_TTL_S, digest, len(up), *up, *users]
        found = int(script(keys=keys, args=args))
        if found != -2:
            return found
    raise MetadataError(
        f"the versions using {digest} changed under its trim {defaults.SCRIPT_KEY_RETRIES}"
        " times in a row; the next sweep tries again."
    )


def clear(md: Metadata, digest: str, node_id: str) -> None:
    """Step C: the delete is done, a store may send the blob to this node again."""
    md.r.delete(K.TRIM_MARK.format(digest=digest, node_id=node_id))


def marked(md: Metadata, digest: str, node_ids: Iterable[str]) -> set[str]:
    """Those of `node_ids` whose copy of `digest` a trim is deleting right now."""
    ids = list(node_ids)
    if not ids:
        return set()
    keys = [K.TRIM_MARK.format(digest=digest, node_id=n) for n in ids]
    return {n for n, v in zip(ids, md.r.mget(keys), strict=True) if v is not None}


def placement_marked(
    md: Metadata, digest: str, node_ids: Iterable[str], unreachable_of: Iterable[str] = ()
) -> tuple[set[str], set[str], set[str]]:
    """What a delivery reads before a put, in one round trip: the nodes holding a verified
    copy of `digest`, those of `node_ids` whose copy a trim is deleting right now, and
    those of `unreachable_of` a transfer lately could not reach (Nodes.unreachable)."""
    ids, others = list(node_ids), list(unreachable_of)
    with md.r.pipeline(transaction=False) as p:
        p.smembers(K.PLACEMENT.format(digest=digest))
        if ids:
            p.mget([K.TRIM_MARK.format(digest=digest, node_id=n) for n in ids])
        if others:
            p.mget(unreachable_keys(others))
        found = p.execute()
    marks = found[1] if ids else []
    gone = found[-1] if others else []
    return (
        set(found[0]),
        {n for n, v in zip(ids, marks, strict=True) if v is not None},
        marked_unreachable(others, gone),
    )
