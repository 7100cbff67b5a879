"""Blobs to all their nodes by chain replication: the default for R >= 2. The chunks of a
version stored at R=1, or with SMOLTORRENT_CHAIN=0, come here too: each copy a chain of
one node, batched as chains are.

The source sends each blob once, to the head of its chain, and the nodes pass it on to
each other (coordinator/dataplane/chain_engine.py). A task delivers one entry (a shard,
or a chunk) or a batch of chunks whose chains go to the same nodes in the same order
(tasks/chain_batches.py), one after the other: what they share (the version's record,
the node registry, their plan entries and spans, the bandwidth meter, the Redis clock)
is read once per task. Every replica settles in the commit barrier on its own, as a
per-replica transfer does: a placed one at once, with the node that really holds it (a
lost node's replica moves to another live node). An entry that fails does not stop the
others; the task then retries with the same exact 2^n backoff, and dead-letters when the
retries run out. A retry only moves what is still unsettled: an entry placed by an
earlier try settles as held and moves nothing.
"""

from __future__ import annotations

import json
from collections import Counter

from celery.utils.log import get_task_logger

from coordinator import config
from coordinator.dataplane.bandwidth import raw_size
from coordinator.dataplane.chain_engine import Target, pick_spare, store_shard_chain
from coordinator.dataplane.chunk_source import release, spool_dir
from coordinator.dataplane.node_client import KeptConnections
from coordinator.plan.source_file import SourceIdentity
from coordinator.state import trim_marks
from coordinator.state.transfers import AttemptClock, Settle
from coordinator.state.versions import ABORTED, REMOVED, REMOVING
from smoltorrent import defaults
from smoltorrent.errors import (
    NodeError,
    NodeUnavailableError,
    NotFoundError,
    SourceChangedError,
)
from tasks.app import app
from tasks.chain_batches import ChainEntry, chain_entries
from tasks.context import metadata, node_client
from tasks.delivery_policy import DELIVERY_TASK_OPTIONS, RETRYABLE, abandon, wait_for_remove
from tasks.enqueue import settle_all
from tasks.sent_progress import SentRecorder, delivery_meter, record_wire

log = get_task_logger(__name__)

MOVED = ("sent", "replicated")  # how a node got a blob when bytes went to it


class _Trimming(Exception):
    """A trim is deleting a target's copy of an entry's blob: a put now could land before
    that delete, so the entry waits for the task's next try."""


@app.task(name="smoltorrent.chain", **DELIVERY_TASK_OPTIONS)
def chain_transfer(
    self,
    vkey: str,
    name: str,
    shard: int,
    replicas: list[int],
    node_ids: list[str],
    digest: str,
    same: list[int] = (),
    more: list[dict] = (),
) -> dict:
    """Make the nodes of `node_ids` (replicas `replicas` of shard `shard`, in chain order)
    hold the shard, and each entry of `more` (the same fields) its own; settle each
    replica in the barrier as it is placed, for the entry and for the later entries `same`
    with its blob (tasks/enqueue.py send_transfers). Returns how each node got them:
    {"how": ..., "nodes": {node id: "sent" | "replicated" | "exists"},
    "bytes": {node id: blob bytes moved onto it}}."""
    md = metadata()
    try:
        v = md.versions.version(vkey)
    except NotFoundError:
        return {"how": "version removed", "nodes": {}}
    if v["state"] in (ABORTED, REMOVING, REMOVED):
        return {"how": f"version {v['state']}", "nodes": {}}
    entries = chain_entries(
        {
            "shard": shard,
            "replicas": replicas,
            "node_ids": node_ids,
            "digest": digest,
            "same": same,
            "more": more,
        }
    )
    if md.blobs.any_deleting(e.digest for e in entries):
        wait_for_remove(
            self, next((e.digest for e in entries if md.blobs.blob_deleting(e.digest)), "")
        )
    run = _Run(self, md, vkey, name, v, entries)
    failures: list[tuple[str | None, Exception]] = []
    trimming = False
    try:
        for entry in entries:
            try:
                failures += run.deliver(entry)
            except _Trimming:
                trimming = True
            except SourceChangedError as exc:
                abandon(vkey, v, str(exc))
                return {"how": "source changed", "nodes": {}}
            except RETRYABLE as exc:  # this entry's, and the others still go
                failures.append((None, exc))
    finally:
        run.kept.close()
        record_wire(md, vkey, run.meter)
    if failures:
        raise _one_error(failures)
    if trimming:
        raise self.retry(countdown=defaults.REMOVING_WAIT_S)
    return {"how": "+".join(sorted(run.hows)), "nodes": run.nodes, "bytes": dict(run.moved)}


def _one_error(failures: list[tuple[str | None, Exception]]) -> Exception:
    """The error the task retries on (autoretry_for): the first retryable one; a dead
    letter names the nodes that failed, not the whole chain."""
    errors = [exc for _, exc in failures]
    first = next((e for e in errors if isinstance(e, RETRYABLE)), None)
    error = first or NodeError("internal", "; ".join(str(e) for e in errors))
    nodes = [node for node, _ in failures if node is not None]
    if nodes:
        error.node_id = ",".join(dict.fromkeys(nodes))
    return error


class _Run:
    """One run of a chain task: what its entries share, and what they did."""

    def __init__(self, task, md, vkey: str, name: str, version: dict, entries) -> None:
        self.task, self.md, self.vkey, self.name, self.version = task, md, vkey, name, version
        shards = [e.shard for e in entries]
        self.spans = md.transfers.spans(vkey, shards)
        self.plans = md.transfers.plan_of(vkey, shards)
        self.registered = md.nodes.nodes()
        # What the barrier compares the settled set with: fixed when the version was created.
        self.counts = (version.get("transfers") or 0, version.get("shards") or 0)
        self.meter = delivery_meter(version, vkey)  # what the source sends, on one bucket
        self.clock = AttemptClock(md.r)
        self.progress = SentRecorder(md, vkey)
        self.hows: set[str] = set()
        self.nodes: dict[str, str] = {}  # node -> how it got the blobs (moved wins)
        self.moved: Counter[str] = Counter()  # node -> blob bytes moved onto it
        # The entries' chain puts share a connection to their head node (closed by the task).
        self.kept = KeptConnections()

    def settle(
        self,
        entry: ChainEntry,
        placed: list[tuple[int, str]],
        held: bool = False,
        attempts: list[dict] = (),
    ) -> None:
        """Settle `placed` (replica, node) of `entry`, after its `attempts`: one round trip."""
        settle_all(
            self.vkey,
            [Settle(entry.shard, r, node, entry.digest, held) for r, node in placed],
            self.name,
            same=entry.same,
            counts=self.counts,
            attempts=attempts,
            at=self.clock.now() if attempts else 0.0,
        )

    def vouch(self, digest: str, size: int, node_ids: set[str]) -> tuple[set[str], set[str]]:
        """Have each of `node_ids` (holders of `digest` whose copy this entry would count)
        re-hash its copy, as a put to a node that holds the blob does (a body-less
        chain_put: no byte sent, progress frames while it hashes): (bad, silent), the
        nodes whose copy is not good (quarantined there and out of the placement, so the
        chunk is sent to them again) and those that did not answer (not counted now: their
        replica goes to a spare, or waits for a retry)."""
        bad, silent = set(), set()
        for node_id in sorted(node_ids):
            if node_id not in self.registered:
                silent.add(node_id)
                continue
            client = node_client(node_id, self.registered).keeping(self.kept)
            try:
                client.chain_put(digest, b"", None, 0, size, [])
            except NodeError as exc:
                if exc.code != "missing":
                    silent.add(node_id)
                    continue
                self.md.blobs.remove_placement(digest, node_id)
                bad.add(node_id)
                log.warning(
                    "%s: the copy of %s on %s is bad; quarantined there, sent again",
                    self.name,
                    digest[:12],
                    node_id,
                )
            except RETRYABLE:
                silent.add(node_id)
        return bad, silent

    def deliver(self, entry: ChainEntry) -> list[tuple[str, Exception]]:
        """Place one entry's replicas and settle those placed; (node, error) of each
        replica that could not be placed."""
        md, vkey, shard, digest = self.md, self.vkey, entry.shard, entry.digest
        span, plan = self.spans[shard], self.plans[shard]
        # The plan names the node a replica moved to if an earlier try replaced a lost one.
        planned = [
            (r, plan[r] if r < len(plan) else n)
            for r, n in zip(entry.replicas, entry.node_ids, strict=True)
        ]
        registered = self.registered
        # Nodes another transfer (or an earlier entry) just could not reach: neither a
        # target nor a spare while another node can take the copy, so this entry does not
        # wait out the same timeout. Read per entry (another task may have found one), with
        # the placement and the trim marks: one round trip.
        holding, marked, unreachable = trim_marks.placement_marked(
            md, digest, (n for _, n in planned), registered
        )
        # A copy this version counts must be good now, not when it was written: a
        # deduplicated chunk's copy may have rotted since.
        bad, silent = self.vouch(digest, span.size, {n for _, n in planned} & holding)
        holding -= bad | silent
        unreachable |= silent
        # A replica is done when its node holds a verified copy (settled is not enough: a
        # dead letter settles too, and its replay must still place the copy).
        todo = [(r, n) for r, n in planned if n not in holding]
        if marked & {n for _, n in todo}:
            raise _Trimming
        # Placed by an earlier try that died before settling them. held: refused if a trim
        # took the node out of the placement since the read above.
        self.settle(entry, [(r, n) for r, n in planned if n in holding], held=True)
        if not todo:
            self.hows.add("exists")
            return []
        keep_off = set(plan) | holding | {n for _, n in todo}

        def spare(seen: set[str]) -> Target | None:
            found = spare_for(
                registered,
                keep_off | seen | unreachable,
                span.size,
                md.transfers.plan(vkey),
                digest,
            )
            if found is not None:
                found.client = found.client.paced(self.meter)
            return found

        def target(r: int, n: str) -> Target:
            client = node_client(n, registered).keeping(self.kept)
            return Target(r, n, client.paced(self.meter))

        targets, lost = [], []
        for r, n in todo:  # in chain order; nodes holding the blob head it (holders below)
            if n in registered and n not in unreachable:
                targets.append(target(r, n))
            else:
                lost.append((r, n))
        for r, n in lost:  # removed from the cluster or unreachable: another takes the replica
            replacement = spare({t.node_id for t in targets})
            if replacement is None and n in registered:  # no other node: try it after all
                targets.append(target(r, n))
                continue
            if replacement is None:
                raise NodeUnavailableError(
                    f"node {n} is not registered and no other node can hold"
                    f" shard {shard}; see `smoltorrent nodes ls`."
                )
            replacement.replica = r
            keep_off.add(replacement.node_id)
            for index in [shard, *entry.same]:
                md.transfers.replace_target(vkey, index, r, n, replacement.node_id)
            targets.append(replacement)
        # A node holding the blob heads the chain and pushes its own copy, unless every
        # copy is to come from here (SMOLTORRENT_CHAIN=0: nodes that may not reach each other).
        pushers = holding if config.chain_replication() else set()
        holders = [
            node_client(h, registered)
            for h in sorted(pushers)
            if h in registered and h not in {t.node_id for t in targets}
        ]
        base = {"shard": shard, "attempt": self.task.request.retries, "chain": True}
        try:
            outcome = store_shard_chain(
                self.version["path"],
                SourceIdentity.from_dict(json.loads(self.version["identity"])),
                span,
                targets,
                holders,
                spare,
                self.progress.of(shard),
                spool_dir(config.spool_root(), vkey),
            )
        except SourceChangedError as exc:
            md.transfers.record_attempts(vkey, [{**base, "error": str(exc)}], self.clock.now())
            raise
        # Raw bytes once per send from the source (one send feeds the whole chain).
        self.meter.raw(raw_size(span) * (outcome.bytes_from_source // max(span.size, 1)))
        for r, (old, new) in outcome.replaced.items():
            if r not in outcome.placed:
                continue
            for index in [shard, *entry.same]:
                if md.transfers.replace_target(vkey, index, r, old, new):
                    log.warning(
                        "%s shard %d: replica %d moved from node %s to %s",
                        self.name,
                        index,
                        r,
                        old,
                        new,
                    )
        errors = [(node, exc) for _, node, exc in outcome.lost] + list(outcome.failed.values())
        md.nodes.mark_unreachable(
            {node for node, exc in errors if isinstance(exc, NodeUnavailableError)}
        )
        attempts = [
            {**base, "replica": r, "node": node, "error": f"replaced: {exc}"}
            for r, node, exc in outcome.lost
        ]
        attempts += [
            {**base, "replica": r, "node": node, "result": how}
            for r, (node, how) in sorted(outcome.placed.items())
        ]
        attempts += [
            {**base, "replica": r, "node": node, "error": str(exc)}
            for r, (node, exc) in sorted(outcome.failed.items())
        ]
        # One round trip for the entry's attempts and then its settles: whoever sees the
        # version commit sees them.
        placed = sorted(outcome.placed.items())
        self.settle(entry, [(r, node) for r, (node, _) in placed], attempts=attempts)
        for _, (node, how) in placed:
            self.hows.add(how)
            if how in MOVED:
                self.nodes[node] = how
                self.moved[node] += span.size
            else:
                self.nodes.setdefault(node, how)
        if not outcome.failed:
            # Every replica of this chain is placed: its spooled chunk is done.
            release(span, spool_dir(config.spool_root(), vkey))
        return list(outcome.failed.values())


def spare_for(
    registered, keep_off: set[str], size: int, plan: list[list[str]], digest: str
) -> Target | None:
    """Another node for a lost replica (see chain_engine.pick_spare), as a chain target:
    the version's plan says how many replicas each node already takes."""
    candidates = {n: rec.address for n, rec in registered.items() if n not in keep_off}
    planned = Counter(n for nodes in plan for n in nodes)
    node_id = pick_spare(candidates, size, config.cluster_key(), planned=planned, spread=digest)
    return None if node_id is None else Target(-1, node_id, node_client(node_id, registered))
