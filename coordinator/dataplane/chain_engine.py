"""Store one shard on several nodes by chain replication, and settle every replica's fate.

The source sends the shard once, to the head of the chain; each node keeps a copy and
passes the bytes on while they arrive (worker_server/chain.py). The report that comes
back says, node by node, which copies are verified. What the chain could not place is
tried again in rounds, never by the source when a node already holds a verified copy:

- a node that already holds the blob heads the chain and pushes its own copy;
- a head the source cannot reach is dropped and the next node heads the chain;
- a node another node could not reach gets one direct try from the source (a link
  between two nodes may be down while both still answer us);
- only the first digest mismatch in a chain is that node's fault: the nodes after it
  received the same bad bytes and are tried again;
- a target that stops answering, is full, or stored other bytes than an unchanged
  source sent (its disk, RAM or link corrupts data) is replaced by `spare` (another live
  node that does not hold the blob), so the shard still ends at R copies on good nodes.

Whatever is still unplaced at the end is returned with its error: the caller retries
it, and dead-letters it when the retries run out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from coordinator.dataplane.chunk_source import sendable
from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.dataplane.store_engine import mismatch_cause
from coordinator.plan.blob_spans import BlobSpan
from coordinator.plan.source_file import SourceIdentity
from smoltorrent import defaults
from smoltorrent.errors import (
    BadTargetError,
    DigestMismatchError,
    NodeError,
    NodeUnavailableError,
    ProtocolError,
    SmoltorrentError,
    SourceChangedError,
)

# Errors that make a target worth replacing by another node: it does not answer, it
# cannot hold the blob (no space, or its disk fails), or it corrupted what it was sent
# (BadTargetError: the source was re-hashed and is unchanged). A corrupting node is
# replaced at its first mismatch, not after its retries: a retry costs the same bytes as a
# send to a spare and is far less likely to land, and the mismatch stays on record
# (attempts, the worker's log). A node that refuses for other reasons is retried and
# dead-lettered, so that stays visible.
REPLACEABLE_CODES = frozenset({"peer_unavailable", "disk_full", "disk_error"})
NODE_FAILURES = (NodeUnavailableError, NodeError, ProtocolError, DigestMismatchError)


@dataclass
class Target:
    replica: int
    node_id: str
    client: NodeClient


@dataclass
class ChainOutcome:
    """Per replica index: how it was placed and where, or why it was not."""

    placed: dict[int, tuple[str, str]] = field(default_factory=dict)  # replica -> (node, how)
    failed: dict[int, tuple[str, Exception]] = field(default_factory=dict)  # -> (node, error)
    replaced: dict[int, tuple[str, str]] = field(default_factory=dict)  # -> (old, new node)
    lost: list[tuple[int, str, Exception]] = field(default_factory=list)  # replaced: why
    bytes_from_source: int = 0  # what the source's own link carried


def replaceable(exc: Exception) -> bool:
    if isinstance(exc, NodeUnavailableError | BadTargetError):
        return True
    return isinstance(exc, NodeError) and exc.code in REPLACEABLE_CODES


def _fate_error(target: Target, fate: dict) -> Exception:
    code, message = fate.get("error", "internal"), fate.get("message", "")
    text = f"node {target.client.address} (chain): {message}"
    if code == "digest_mismatch":
        return BadTargetError(
            f"node {target.client.address} stored other bytes than its chain passed on: {message}",
        )
    if code == "peer_unavailable":
        return NodeUnavailableError(text)
    return NodeError(code, text)


def store_shard_chain(
    path: str,
    identity: SourceIdentity,
    span: BlobSpan,
    targets: list[Target],
    holders: list[NodeClient] = (),
    spare: Callable[[set[str]], Target | None] | None = None,
    progress: Callable[[Sequence[int], int], None] | None = None,
    spool: str = "",
) -> ChainOutcome:
    """Make every target hold the shard of `span`, by chain; see the module docstring.
    progress(replicas, n) follows a send from the source: the chain feeding `replicas` has
    been sent n bytes of the shard's range (each node passes them on as they arrive). An
    encoded chunk is sent from its spooled file, encoded again into `spool` only when the
    source must send it and that file is gone (coordinator/dataplane/chunk_source.py)."""
    shard_index, digest = span.index, span.digest
    out = ChainOutcome()
    todo = list(targets)  # in chain order
    sources = list(holders)  # nodes holding a verified copy: they head the chain
    direct = set()  # node ids to try once from the source alone
    tried_direct: set[str] = set()
    seen = {t.node_id for t in targets}

    def give_up(target: Target, exc: Exception) -> None:
        todo.remove(target)
        replacement = spare(seen) if spare is not None and replaceable(exc) else None
        if replacement is None:
            out.failed[target.replica] = (target.node_id, exc)
            return
        seen.add(replacement.node_id)
        out.lost.append((target.replica, target.node_id, exc))
        replacement.replica = target.replica
        out.replaced[target.replica] = (
            out.replaced.get(target.replica, (target.node_id, ""))[0],
            replacement.node_id,
        )
        todo.append(replacement)

    def placed(target: Target, how: str, client: NodeClient) -> None:
        todo.remove(target)
        out.placed[target.replica] = (target.node_id, how)
        sources.append(client)

    def source_changed_or_bad(target: Target, exc: Exception) -> Exception:
        """A head hashed other bytes than the plan: the source changed, or the head is bad."""
        cause = mismatch_cause(identity, path, span, target.client.address, exc)
        if isinstance(cause, SourceChangedError):
            raise cause from exc  # the whole version is abandoned, not one target
        return cause

    # Each round places at least one target, gives one up, drops a source or uses up a
    # direct try; bounded all the same, so a confused node cannot loop us.
    for _ in range(4 * (len(targets) + len(sources)) + 4):
        if not todo:
            break
        alone = [t for t in todo if t.node_id in direct]
        if alone:
            head_target, chain, head_client = alone[0], [], alone[0].client
            direct.discard(head_target.node_id)
        elif sources:
            head_target, chain, head_client = None, list(todo), sources[0]
        else:
            head_target, chain, head_client = todo[0], todo[1:], todo[0].client
        sending = None  # a node holding the blob heads: no byte leaves the source
        # An encoded chunk headed by a holder: the holder pushes its own copy, so the
        # source neither reads its spooled file nor encodes it again (a source rewritten
        # since would abandon a version whose blob a node still holds). A holder that lost
        # its copy asks for the bytes and is dropped; the source heads the next round.
        holder_only = head_target is None and span.spool is not None
        if span.spool is not None and not holder_only:
            # An encoded chunk the source sends: the chain announces its encoded blob, from
            # the spooled file (encoded again if that is gone). Announced as the chunk's raw
            # range, a holder heading the chain asked for the raw bytes under the blob's
            # digest, and every node refused them.
            path, identity, span = sendable(path, identity, span, spool)
        if head_target is not None:
            identity.check(path)
            if progress is not None:
                sending = partial(progress, [t.replica for t in [head_target, *chain]])
        forward = [t.client.address for t in chain]
        try:
            if holder_only:  # the encoded blob's size, and no bytes to give
                report = head_client.chain_put(digest, b"", None, 0, span.size, forward)
            else:
                with open(path, "rb") as f:
                    report = head_client.chain_put(
                        digest, span.prefix, f.fileno(), span.offset, span.length, forward, sending
                    )
        except DigestMismatchError as exc:  # not a chain report: a plain refusal
            if head_target is None:
                sources.remove(head_client)
                continue
            give_up(head_target, source_changed_or_bad(head_target, exc))
            continue
        except NODE_FAILURES as exc:
            if head_target is None:
                sources.remove(head_client)  # the holder is gone or bad: the next one heads
            else:
                give_up(head_target, exc)
            continue
        out.bytes_from_source += report.sent
        tainted = False  # a node in this chain stored other bytes: the ones after it got them
        if head_target is not None:
            fate = report.head
            if fate["node_id"] not in (None, head_target.node_id):
                give_up(head_target, NodeError("internal", _wrong_node(head_target, fate)))
            elif fate["status"] != "failed":
                placed(head_target, "sent" if report.sent else "exists", head_client)
            elif fate.get("error") == "digest_mismatch":
                tainted = True
                give_up(
                    head_target, source_changed_or_bad(head_target, _fate_error(head_target, fate))
                )
            else:
                give_up(head_target, _fate_error(head_target, fate))
        elif report.head["status"] == "failed":
            sources.remove(head_client)  # its copy went bad meanwhile
        for target, (_, fate) in zip(chain, report.forward, strict=True):
            if target not in todo:
                continue
            if fate["node_id"] not in (None, target.node_id):
                give_up(target, NodeError("internal", _wrong_node(target, fate)))
            elif fate["status"] != "failed":
                placed(
                    target, "replicated" if fate["status"] == "stored" else "exists", target.client
                )
            elif fate.get("error") == "digest_mismatch":
                if not tainted:
                    tainted = True
                    give_up(target, _fate_error(target, fate))
                # else: it got the bad bytes of a node before it; it stays for the next round
            elif fate.get("error") == "peer_unavailable" and target.node_id not in tried_direct:
                tried_direct.add(target.node_id)  # another node could not reach it: can we?
                direct.add(target.node_id)
            else:
                give_up(target, _fate_error(target, fate))
    for target in todo:
        out.failed[target.replica] = (
            target.node_id,
            NodeError(
                "internal", f"shard {shard_index} did not reach node {target.client.address}"
            ),
        )
    return out


def _wrong_node(target: Target, fate: dict) -> str:
    return (
        f"node {target.client.address} answered as node {fate['node_id']}, not"
        f" {target.node_id}: its address now belongs to another node; update it with"
        " `smoltorrent nodes add`"
    )


def pick_spare(
    candidates: dict[str, NodeAddress],
    size: int,
    cluster_key: bytes | None,
    *,
    planned: Mapping[str, int] | None = None,
    spread: str = "",
) -> str | None:
    """The node to take a lost replica: among `candidates` (registered nodes that neither
    hold the blob nor are planned or tried for it), one answering a stat now, under its own
    id, with room for `size` bytes. Of those, the one with the fewest replicas `planned`
    for the version, then the most room (within PLACEMENT_EQUAL_FREE_SHARE of the roomiest
    counts as equal); ties are broken by a hash of `spread` (the blob's digest) with the
    node id, so the replicas of a lost node, replaced at the same moment by tasks that do
    not see each other's choice, spread over the nodes rather than all landing on one."""
    room: dict[str, int] = {}
    for node_id in sorted(candidates):
        probe = NodeClient(
            candidates[node_id], cluster_key=cluster_key, timeout=defaults.CONNECT_TIMEOUT_S
        )
        try:
            stat = probe.stat()
        except (SmoltorrentError, OSError):
            continue
        if stat.node_id == node_id and stat.free_bytes >= size:
            room[node_id] = stat.free_bytes
    if not room:
        return None
    roomiest = max(max(room.values()), 1)
    step = defaults.PLACEMENT_EQUAL_FREE_SHARE
    return min(
        room,
        key=lambda n: (
            (planned or {}).get(n, 0),
            -round(room[n] / roomiest / step),
            hashlib.sha256(f"{spread}:{n}".encode()).digest(),
        ),
    )
