"""`smoltorrent verify`: scrub and repair now, for every committed version or one
checkpoint's, instead of waiting for the sweeps; what was found and done.

Every up node re-hashes the copies the placement says it holds (at full speed: someone
asked), a bad or missing copy leaves the placement (a bad one is quarantined by its
node), then the blobs below R are copied node to node right here, one at a time, with the
repair sweep's rules, its rate (`rate` bytes/s, the node's repair bucket) and its
in-flight records (so the two never send the same copy),
and quarantined copies with a good copy elsewhere are discarded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from coordinator.dataplane.node_client import NodeClient
from coordinator.state import repairs, scrub_reports
from coordinator.state.healing import UNREACHABLE, copy_blobs, settle_quarantined
from coordinator.state.liveness import DEAD, DOWN, node_health, probe_registered
from coordinator.state.metadata import Metadata
from coordinator.state.repair_plan import plan, wanted_blobs
from coordinator.state.versions import COMMITTED
from smoltorrent.errors import NotFoundError


def _placements(md: Metadata, digests) -> dict[str, frozenset[str]]:
    """Digest -> node ids of its verified copies, PLACEMENT_BATCH_DIGESTS a round trip (every
    blob of every committed version: 100,000 in one pipeline held a command and a reply
    each at once)."""
    digests = list(digests)
    return dict(zip(digests, md.blobs.placement_of(digests), strict=True))


def verify_now(
    md: Metadata,
    cluster_key: bytes | None,
    *,
    dead_after: float,
    per_node: int,
    rate: int = 0,
    name: str | None = None,
) -> dict[str, Any]:
    nodes = md.nodes.nodes()
    live = probe_registered(md, cluster_key)
    health = node_health(md, dead_after, set(live))
    counted = {n for n, h in health.items() if h.state != DEAD}
    vkeys = [
        vkey
        for vkey, v in md.listing.versions_in(COMMITTED)
        if name is None or v.get("name") == name
    ]
    if name is not None and not vkeys:
        raise NotFoundError(f"{name} has no committed version; see `smoltorrent ls`.")
    blobs = wanted_blobs(md, vkeys)
    placement = _placements(md, blobs)
    report: dict[str, Any] = {
        "name": name,
        "blobs": len(blobs),
        "copies_checked": 0,
        "nodes_checked": [],
        "nodes_unreachable": sorted(set(nodes) - set(live)),
        "bad": [],
        "repaired": [],
        "failed": [],
        "discarded": [],
    }

    # 1. Re-hash now: every up node, the copies it is said to hold.
    quarantined: dict[str, list[str]] = {}
    for node_id in sorted(live):
        expected = sorted(d for d in blobs if node_id in placement[d])
        client = NodeClient(nodes[node_id].address, cluster_key=cluster_key)
        try:
            bad = client.verify(expected) if expected else []
            scrub = client.scrub(start=False)
        except UNREACHABLE:
            report["nodes_unreachable"].append(node_id)
            continue
        report["nodes_checked"].append(node_id)
        report["copies_checked"] += len(expected)
        held = set(scrub_reports.record(md, node_id, scrub)["quarantined"])
        quarantined[node_id] = sorted(held)
        for digest in bad:
            md.blobs.remove_placement(digest, node_id)
            problem = "bad" if digest in held else "missing"
            report["bad"].append({"digest": digest, "node": node_id, "problem": problem})
        # Bad copies its own scrub found earlier leave the placement too (the sweep may not
        # have read them yet).
        early = settle_quarantined(md, nodes, cluster_key, node_id, sorted(held), counted)
        report["bad"] += [
            {"digest": d, "node": node_id, "problem": "bad"}
            for d in early["released"]
            if d not in bad
        ]
        report["discarded"] += [{"digest": d, "node": node_id} for d in early["discarded"]]

    # 2. Repair now, fewest copies first, until nothing is left that a copy can fix.
    free = {n: s.free_bytes for n, s in live.items()}
    while True:
        decided = plan(
            blobs,
            _placements(md, blobs),
            health,
            free,
            repairs.in_flight(md),
            per_node=per_node,
            max_in_flight=len(nodes) * per_node,
        )
        progress = False
        for r in decided.repairs:
            if not repairs.claim(md, r.digest, r.target, r.source, r.size, 3600):
                continue
            try:
                copied = copy_blobs(md, nodes, cluster_key, [r.digest], r.source, r.target, rate)
                how = copied[r.digest]
            except UNREACHABLE as exc:
                how, failed = "failed", (r.source, r.target)
                error = str(exc)
            else:
                # The target refused or failed its copy: it takes none again in this run.
                failed = (r.target,) if how.startswith("failed: ") else ()
                error = how.removeprefix("failed: ")
            finally:
                repairs.finished(md, r.digest, r.target)
            if failed:
                report["failed"].append(
                    {"digest": r.digest, "source": r.source, "target": r.target, "error": error}
                )
                # Not again in this run (the sweep retries).
                for n in failed:
                    health[n] = dataclasses.replace(health[n], state=DOWN)
                continue
            if how in ("stored", "exists"):
                free[r.target] = free.get(r.target, 0) - r.size
                report["repaired"].append(
                    {"digest": r.digest, "source": r.source, "target": r.target}
                )
            progress = True
        if not progress:
            break

    # 3. Bad copies with a good copy elsewhere now go.
    for node_id, digests in quarantined.items():
        try:
            done = settle_quarantined(md, nodes, cluster_key, node_id, digests, counted)
        except UNREACHABLE:
            continue
        report["discarded"] += [{"digest": d, "node": node_id} for d in done["discarded"]]

    # Only copies re-hashed just now (or made just now) count as verified: a node that did
    # not answer may still hold good ones, but this run cannot say so.
    final = _placements(md, blobs)
    checked = set(report["nodes_checked"])
    report["under_replicated"] = sorted(
        d for d, b in blobs.items() if len(final[d] & checked) < b.replicas
    )
    report["unrepairable"] = [{"digest": d, **info} for d, info in decided.unrepairable.items()]
    report["nodes_unreachable"] = sorted(set(report["nodes_unreachable"]))
    return report
