"""Nothing leaks (invariant 14): once the sweeps have run, every blob on a node is used by
a version or on its way to collection, and Redis's references equal what the manifests
imply. The fault runs (coordinator/local/chaos/) check it at the end of every run.

A version holds references to its manifest's blobs from its create until its remove
begins (pending, committed, aborted); removing and removed ones hold none. A blob on a
node that no such version uses is an orphan: the crosscheck notes it (`ORPHANS`) and
collects it after the grace, so one it has noted is being collected, not leaked.
"""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.plan.manifest import Manifest
from coordinator.state import redis_keys as K
from coordinator.state.metadata import Metadata
from coordinator.state.versions import ABORTED, COMMITTED, PENDING, digests

HOLDING = (PENDING, COMMITTED, ABORTED)  # the states whose versions hold references


def implied_references(md: Metadata) -> dict[str, set[str]]:
    """Blob digest -> the versions whose manifest uses it, of the versions holding
    references (read from their manifests in Redis)."""
    implied: dict[str, set[str]] = {}
    for vkey, state in md.listing.version_states().items():
        if state not in HOLDING:
            continue
        raw = md.r.get(K.MANIFEST.format(vkey=vkey))
        if raw is None:
            continue
        for digest in digests(Manifest.from_json(raw)):
            implied.setdefault(digest, set()).add(vkey)
    return implied


def recorded_references(md: Metadata) -> dict[str, set[str]]:
    """Blob digest -> its reference set in Redis (non-empty ones)."""
    pattern = K.BLOB_REFS.format(digest="*")
    head, tail = pattern.split("*")
    out = {}
    for key in md.r.scan_iter(match=pattern, count=1000):
        members = md.r.smembers(key)
        if members:
            out[key[len(head) : len(key) - len(tail)]] = set(members)
    return out


def find_leaks(md: Metadata, inventories: Mapping[str, set[str]]) -> list[str]:
    """One sentence per leak: a reference Redis holds that no manifest implies, one a
    manifest implies that Redis lacks, and a blob on a node (`inventories`: node id -> the
    digests it holds) that no version uses and the crosscheck has not noted for
    collection. Empty when nothing leaks."""
    implied = implied_references(md)
    recorded = recorded_references(md)
    leaks = []
    for digest in sorted(implied.keys() | recorded.keys()):
        extra = recorded.get(digest, set()) - implied.get(digest, set())
        lacking = implied.get(digest, set()) - recorded.get(digest, set())
        if extra:
            leaks.append(
                f"blob {digest[:12]} is referenced in Redis by {sorted(extra)}, whose"
                " manifests do not use it (no remove would take those references away)"
            )
        if lacking:
            leaks.append(
                f"blob {digest[:12]} is used by {sorted(lacking)} but not in its references"
                " (a remove could delete it under them)"
            )
    noted = md.blobs.orphan_marks()
    for node_id, held in sorted(inventories.items()):
        for digest in sorted(held):
            if digest not in implied and f"{digest}:{node_id}" not in noted:
                leaks.append(
                    f"blob {digest[:12]} on node {node_id[:12]} is used by no version and"
                    " not noted by the crosscheck for collection"
                )
    return leaks
