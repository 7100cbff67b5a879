"""What the repair sweep must do: which blobs are below R copies on nodes that are not
dead, which node copies each to which, and which blobs have copies to spare.

Decided from Redis alone (placement, liveness, repairs in flight), so the sweep can run
it every few seconds; coordinator/state/healing.py carries each step out. Rules:
- A copy counts unless its node is dead (silent past the dead timeout); only nodes that
  answer now (up) send or receive a copy.
- Order: fewest copies first (a blob down to its last copy before one missing only its
  second), then blobs of a pinned or current version, then the newest versions' blobs.
- Never two copies on one node: a target holds no copy and is not receiving one.
- Blobs that go between the same two nodes travel together: one repair session (one
  task, one node-to-node connection) carries up to REPAIR_BATCH_BLOBS blobs and
  REPAIR_BATCH_BYTES. A copy joins a session of this pass when its source holds the blob
  and its target may take it, unless a holder that sends nothing yet can open its own:
  each node paces its pushes at its repair rate (SMOLTORRENT_REPAIR_BPS), so bytes move
  faster from more senders, not from more sessions of one.
- A safety cap on top of the rate: at most `per_node` sessions touch a node at once (as
  sender or receiver), at most `max_in_flight` in the whole cluster.
- A blob that no step can raise now (fewer live nodes than R, no reachable copy, no
  space) is reported, not retried in a loop: the next pass looks again.
- A blob with more copies on up nodes than R, and nothing in flight for it, is trimmed,
  unless a pending version's store is still placing it (its R may be higher).
- A pending version's shard counts once every transfer of it has settled (the store no
  longer moves it): below R then, it is repaired like a committed one.
- A target whose copy of a blob failed lately waits out its backoff (another target
  may take the copy meanwhile); see coordinator/state/repairs.py.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from coordinator.state import redis_keys as K
from coordinator.state.liveness import DEAD, UP, NodeHealth, node_health
from coordinator.state.metadata import Metadata
from coordinator.state.repairs import InFlight
from coordinator.state.versions import COMMITTED, PENDING
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError

TRIM = "trim"  # the target of an in-flight record that is a trim, not a copy


@dataclass(frozen=True)
class Blob:
    digest: str
    size: int
    replicas: int  # the most copies any version using it asks for
    names: tuple[str, ...]  # checkpoints using it, for status
    placing: bool = False  # a pending version's store is still placing it: never trimmed
    favoured: bool = False  # a pinned or current version uses it: repaired before the others
    newest: int = 0  # the listing position of the newest version using it (higher: newer)


@dataclass(frozen=True)
class Repair:
    digest: str
    source: str
    target: str
    size: int
    copies: int  # copies that count before this repair
    session: int = 0  # which of the plan's sessions carries it (Plan.sessions)


@dataclass
class Plan:
    repairs: list[Repair] = field(default_factory=list)  # in the order decided
    trims: list[str] = field(default_factory=list)  # digests with copies to spare
    unrepairable: dict[str, dict] = field(default_factory=dict)
    throttled: int = 0  # copies needed that wait for a free slot
    waiting: int = 0  # copies needed whose only targets wait out a backoff

    def sessions(self) -> list[list[Repair]]:
        """The repairs grouped by the session that carries them (one source, one target),
        each in the order decided, the sessions in the order they were opened."""
        grouped: dict[int, list[Repair]] = {}
        for r in self.repairs:
            grouped.setdefault(r.session, []).append(r)
        return list(grouped.values())

    def counts(self) -> dict[str, int]:
        return {
            "repairs": len(self.repairs),
            "sessions": len(self.sessions()),
            "trims": len(self.trims),
            "unrepairable": len(self.unrepairable),
            "throttled": self.throttled,
            "waiting": self.waiting,
        }


def settled_shards(md: Metadata, vkey: str) -> set[int]:
    """Shards of a pending version its store is done with: every transfer of the shard
    settled and a verified copy placed. The store moves them no more."""
    plan_, (_, settled, ready) = md.transfers.plan(vkey), md.transfers.snapshot(vkey)
    return {
        i
        for i, nodes in enumerate(plan_)
        if i in ready and all(f"{i}:{r}" in settled for r in range(len(nodes)))
    }


def wanted_blobs(md: Metadata, vkeys: Iterable[str] | None = None) -> dict[str, Blob]:
    """Every blob of a committed version (or of `vkeys`), and of a pending version's shards
    its store is done with (settled_shards), with its size, the most copies any version
    using it asks for, and the names using it. The other shards of a pending version are
    left to their own transfers, which retry, replace a lost node and are re-driven by the
    reconcile sweep (a repair racing them could only add a surplus copy); their blobs are
    marked `placing` so no trim races the store either."""
    pending: list[str] = []
    from_listing = vkeys is None
    if vkeys is None:
        listed, states = md.listing.listed_states()
        vkeys = [v for v in listed if states.get(v) == COMMITTED]
        pending = [v for v in listed if states.get(v) == PENDING]
    sizes: dict[str, int] = {}
    replicas: dict[str, int] = {}
    names: dict[str, set[str]] = defaultdict(set)
    placing: set[str] = set()
    favoured: set[str] = set()
    newest: dict[str, int] = {}
    with md.r.pipeline(transaction=False) as p:
        p.hkeys(K.PINS)
        p.hvals(K.CURRENT)
        pins, currents = p.execute()
    kept = set(pins) | set(currents)
    chosen = [(vkey, None) for vkey in vkeys]
    for vkey in pending:
        try:
            chosen.append((vkey, settled_shards(md, vkey)))
        except NotFoundError:
            continue  # committed, aborted or removed since the listing
    if from_listing:  # the sweep: every committed version parsed once, not every pass
        recorded = md.versions.committed_blobs(vkeys)
        recorded.update(md.versions.version_blobs(v for v, done in chosen if done is not None))
    else:
        recorded = md.versions.version_blobs(vkeys)
    # Request order: the committed ones listed first, then the pending ones, each in order.
    position = {vkey: i for i, (vkey, _) in enumerate(chosen)}
    for vkey, done in chosen:
        version = recorded.get(vkey)
        if version is None:
            continue  # removed since the listing
        for i, (d, size) in enumerate(version.blobs):
            if done is not None and i not in done:
                placing.add(d)
                continue
            sizes[d] = size
            replicas[d] = max(replicas.get(d, 0), version.replicas)
            names[d].add(version.name)
            newest[d] = max(newest.get(d, 0), position[vkey])
            if vkey in kept:
                favoured.add(d)
    return {
        d: Blob(
            d,
            sizes[d],
            replicas[d],
            tuple(sorted(names[d])),
            d in placing,
            d in favoured,
            newest[d],
        )
        for d in sizes
    }


def copies_against_wanted(md: Metadata, vkey: str, dead_after: float) -> dict[str, tuple[int, int]]:
    """Digest -> (its copies that count, the most copies any version using it asks for),
    for every blob of committed version `vkey`: what `store --replicas` on stored content
    waits on until the two are equal. A copy counts as in plan(): on a node not dead
    (silent for less than `dead_after` seconds)."""
    blobs = md.versions.version_blobs([vkey]).get(vkey)
    if blobs is None:
        return {}
    wanted = wanted_blobs(md)
    held = placements(md, (d for d, _ in blobs.blobs))
    health = node_health(md, dead_after)
    counted = {n for n, h in health.items() if h.state != DEAD}
    return {
        d: (len(held[d] & counted), wanted[d].replicas if d in wanted else blobs.replicas)
        for d, _ in blobs.blobs
    }


def placements(md: Metadata, digests: Iterable[str]) -> dict[str, set[str]]:
    """Digest -> node ids of its verified copies, PLACEMENT_BATCH_DIGESTS a round trip
    (Blobs.placement_of): the repair sweep's 100,000 blobs were one pipeline of as many
    commands, their replies all held at once."""
    digests = list(digests)
    found = md.blobs.placement_of(digests)
    return {d: set(nodes) for d, nodes in zip(digests, found, strict=True)}


def plan(
    blobs: Mapping[str, Blob],
    placement: Mapping[str, set[str]],
    health: Mapping[str, NodeHealth],
    free_bytes: Mapping[str, int],
    busy: Iterable[InFlight],
    *,
    per_node: int,
    max_in_flight: int,
    backoff: Mapping[str, set[str]] | None = None,
) -> Plan:
    """Decide one pass (pure: every input passed in). `backoff`: digest -> the targets
    whose copy of it failed lately and wait out their backoff."""
    backoff = backoff or {}
    out = Plan()
    up = {n for n, h in health.items() if h.state == UP}
    counted = {n for n, h in health.items() if h.state != DEAD}
    # Sessions, not copies, load a node: the copies of one session share its connection
    # and its sender's rate. A record without a session (sent alone) is a session of one.
    load: Counter[str] = Counter()
    sending: Counter[str] = Counter()
    arriving: dict[str, set[str]] = defaultdict(set)
    # A trim in flight brings no copy: counted as one, a blob that lost a copy while its
    # trim's record lived (an hour, if its message was lost) was never repaired.
    trimming: set[str] = set()
    running: dict[str, tuple[str, str]] = {}
    for r in busy:
        if r.target == TRIM:
            trimming.add(r.digest)
            continue
        arriving[r.digest].add(r.target)
        running[r.session or f"{r.digest}:{r.target}"] = (r.source, r.target)
    for source, target in running.values():
        load[source] += 1
        load[target] += 1
        sending[source] += 1
    in_flight = len(running)
    opened: list[_Session] = []
    free = dict(free_bytes)

    short: list[tuple[int, str]] = []
    for d, blob in blobs.items():
        holders = placement.get(d, set())
        copies = len(holders & counted)
        if copies < blob.replicas:
            short.append((copies, d))
        elif (
            len(holders & up) > blob.replicas
            and not arriving[d]
            and d not in trimming
            and not blob.placing
        ):
            out.trims.append(d)

    short.sort(key=lambda cd: (cd[0], not blobs[cd[1]].favoured, -blobs[cd[1]].newest, cd[1]))
    for copies, d in short:
        blob, holders = blobs[d], placement.get(d, set())
        wanted = blob.replicas - copies - len(arriving[d])
        if wanted <= 0:
            continue
        sources = sorted(holders & up)
        candidates = sorted(up - holders - arriving[d])
        spacious = [n for n in candidates if free.get(n, 0) >= blob.size]
        room = [n for n in spacious if n not in backoff.get(d, ())]
        reason = None
        if not sources:
            on_dead = sorted(holders & (set(health) - counted))
            reason = (
                f"no copy on a node that answers (copies on dead nodes: {', '.join(on_dead)})"
                if on_dead
                else "no copy left on any node that answers"
                if holders & counted
                else "no copy left on any registered node"
            )
        elif len(candidates) < wanted:
            reason = f"{len(up)} live node(s) for {blob.replicas} copies: add or bring back a node"
        elif len(spacious) < wanted:
            reason = f"no live node without a copy has {blob.size} bytes free"
        elif len(room) < wanted:
            out.waiting += wanted - len(room)  # targets backing off: not unrepairable
        if reason is not None:
            out.unrepairable[d] = {
                "copies": copies,
                "replicas": blob.replicas,
                "reason": reason,
                "names": list(blob.names),
            }
        for _ in range(min(wanted, len(room)) if sources else 0):
            source = min(
                (s for s in sources if load[s] < per_node),
                key=lambda s: (sending[s], load[s]),
                default=None,
            )
            # The least busy target first: a node a session already reaches keeps its
            # other slot for the session it sends, or a survivor whose every possible
            # target is full sends nothing (a->b and b->a left c idle).
            target = max(
                (t for t in room if load[t] < per_node),
                key=lambda t: (-load[t], free.get(t, 0)),
                default=None,
            )
            can_open = in_flight < max_in_flight and source is not None and target is not None
            joined = None
            if not (can_open and sending[source] == 0):
                joined = next(
                    (o for o in opened if o.source in sources and o.takes(blob.size, room)),
                    None,
                )
            if joined is None and not can_open:
                out.throttled += 1
                continue
            if joined is None:
                joined = _Session(len(opened), source, target)
                opened.append(joined)
                load[source] += 1
                load[target] += 1
                sending[source] += 1
                in_flight += 1
            joined.blobs += 1
            joined.bytes += blob.size
            out.repairs.append(
                Repair(d, joined.source, joined.target, blob.size, copies, joined.index)
            )
            room.remove(joined.target)
            free[joined.target] = free.get(joined.target, 0) - blob.size
    return out


@dataclass
class _Session:
    """A session opened by this pass: what it carries so far."""

    index: int
    source: str
    target: str
    blobs: int = 0
    bytes: int = 0

    def takes(self, size: int, room: list[str]) -> bool:
        """Whether a blob of `size` bytes that may go to a node in `room` joins it."""
        return (
            self.target in room
            and self.blobs < defaults.REPAIR_BATCH_BLOBS
            and (self.blobs == 0 or self.bytes + size <= defaults.REPAIR_BATCH_BYTES)
        )
