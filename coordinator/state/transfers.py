"""Transfers of a pending version: its placement plan, its shards' blob spans, its attempt
log and progress, and the commit barrier that says when every transfer has settled."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import redis

from coordinator.dataplane.chunk_source import chunk_span
from coordinator.plan.blob_spans import BlobSpan, blob_spans
from coordinator.state import redis_keys as K
from coordinator.state.clock import redis_clock
from coordinator.state.scripts import load
from coordinator.state.versions import Versions
from smoltorrent import defaults
from smoltorrent.errors import CopyBeingTrimmedError, NotFoundError


class Settle(NamedTuple):
    """One replica to record in the commit barrier (Transfers.settle's arguments)."""

    shard: int
    replica: int
    node_id: str | None  # None: the transfer failed for good
    digest: str
    held: bool = False  # counted from the placement, not sent


def _settle_call(vkey: str, s: Settle, counts: Sequence) -> tuple[list[str], list]:
    """The keys and arguments of lua/versions/settle.lua for `s`."""
    node = s.node_id or ""
    keys = [
        K.SETTLED.format(vkey=vkey),
        K.READY.format(vkey=vkey),
        K.VERSION.format(vkey=vkey),
        K.PLACEMENT.format(digest=s.digest),
        K.TRIM_MARK.format(digest=s.digest, node_id=node),
        K.PLACEMENTS_LISTED,
    ]
    args = [
        f"{s.shard}:{s.replica}",
        "" if s.node_id is None else str(s.shard),
        node,
        counts[0] or 0,
        counts[1] or 0,
        "1" if s.held else "",
        s.digest,
    ]
    return keys, args


def being_trimmed(digest: str, node_id: str | None) -> CopyBeingTrimmedError:
    return CopyBeingTrimmedError(
        f"the copy of {digest} on node {node_id} is being trimmed (or was, since it"
        " was counted): it is sent there again"
    )


class AttemptClock:
    """The Redis clock (redis_clock) read once, then followed by this process's monotonic
    clock: a task stamping many attempts pays one TIME round trip, not one each."""

    def __init__(self, r: redis.Redis) -> None:
        self._at, self._since = redis_clock(r), time.monotonic()

    def now(self) -> float:
        return self._at + (time.monotonic() - self._since)


class Transfers:
    def __init__(self, r: redis.Redis, versions: Versions) -> None:
        self.r = r
        self._versions = versions
        self._settle = load(r, "versions/settle")
        self._replace_target = load(r, "versions/replace_target")
        self._reopen = load(r, "versions/reopen")

    def plan(self, vkey: str) -> list[tuple[str, ...]]:
        raw = self.r.hgetall(K.PLAN.format(vkey=vkey))
        return [tuple(json.loads(raw[str(i)])) for i in range(len(raw))]

    def plan_of(self, vkey: str, shards: Sequence[int]) -> dict[int, tuple[str, ...]]:
        """The plan of `shards` alone, in one HMGET: a delivery task reads its own entries,
        not the whole plan (a version of a thousand chunks has a thousand). A shard with no
        plan entry (the version is gone) maps to ()."""
        raws = self.r.hmget(K.PLAN.format(vkey=vkey), [str(s) for s in shards]) if shards else []
        return {
            s: () if raw is None else tuple(json.loads(raw))
            for s, raw in zip(shards, raws, strict=True)
        }

    def replace_target(self, vkey: str, shard: int, replica: int, old: str, new: str) -> bool:
        """The plan of a pending version's shard names `new` for `replica` instead of `old` (a
        node lost mid-store, replaced): re-sends and repairs then aim at the node that holds
        the copy. A no-op (False) once the plan names another node there or the version left
        pending."""
        return bool(
            self._replace_target(
                keys=[K.VERSION.format(vkey=vkey), K.PLAN.format(vkey=vkey)],
                args=[str(shard), replica + 1, old, new],
            )
        )

    def keep_spans(self, vkey: str, spans: Iterable[BlobSpan]) -> None:
        """Record each shard's blob span for the transfers about to run."""
        mapping = {str(span.index): span.to_json() for span in spans}
        if not mapping:
            return
        with self.r.pipeline() as p:
            p.hset(K.SPANS.format(vkey=vkey), mapping=mapping)
            p.expire(K.SPANS.format(vkey=vkey), defaults.SPANS_TTL_S)
            p.execute()

    def span(self, vkey: str, shard: int) -> BlobSpan:
        """The blob span of one shard (see spans)."""
        return self.spans(vkey, [shard])[shard]

    def spans(self, vkey: str, shards: Sequence[int]) -> dict[int, BlobSpan]:
        """The blob spans of `shards`: read in one HMGET while the version's spans are kept,
        else rebuilt from the manifest (a replay after the commit dropped them)."""
        raws = self.r.hmget(K.SPANS.format(vkey=vkey), [str(s) for s in shards]) if shards else []
        out = {s: BlobSpan.from_json(raw) for s, raw in zip(shards, raws, strict=True) if raw}
        missing = [s for s in shards if s not in out]
        if missing:
            manifest = self._versions.manifest(vkey)
            if manifest.chunked:  # an encoded chunk is then encoded again, if it must be sent
                out |= {s: chunk_span(manifest, manifest.chunks[s], "") for s in missing}
            else:
                every = blob_spans(manifest)
                out |= {s: every[s] for s in missing}
        return out

    def record_attempt(self, vkey: str, entry: dict) -> None:
        """Append to the version's attempt log, keeping its last ATTEMPTS_KEPT entries."""
        self.record_attempts(vkey, [entry], redis_clock(self.r))

    def record_attempts(self, vkey: str, entries: Sequence[dict], at: float) -> None:
        """Append `entries`, stamped `at` (seconds on the Redis clock: AttemptClock), to the
        version's attempt log in one round trip, keeping its last ATTEMPTS_KEPT entries."""
        if not entries:
            return
        key = K.ATTEMPTS.format(vkey=vkey)
        with self.r.pipeline() as p:
            p.rpush(key, *(json.dumps({**entry, "at": at}) for entry in entries))
            p.ltrim(key, -defaults.ATTEMPTS_KEPT, -1)
            p.execute()

    def attempts(self, vkey: str) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(K.ATTEMPTS.format(vkey=vkey), 0, -1)]

    def last_activity(self, vkey: str, version: dict[str, str]) -> float:
        """Unix time of the version's last transfer attempt, re-send or creation."""
        last = self.r.lindex(K.ATTEMPTS.format(vkey=vkey), -1)
        return max(
            float(version.get("created_at") or 0),
            float(version.get("resent_at") or 0),
            json.loads(last)["at"] if last else 0.0,
        )

    def mark_resent(self, vkey: str) -> None:
        self.r.hset(K.VERSION.format(vkey=vkey), "resent_at", repr(redis_clock(self.r)))

    def settle(
        self,
        vkey: str,
        shard: int,
        replica: int,
        node_id: str | None,
        digest: str,
        held: bool = False,
        counts: tuple[str, str] | None = None,
    ) -> bool:
        """Record a finished transfer (node_id None when it failed for good); True when the
        set is complete and no commit was enqueued yet: the caller enqueues the commit, then
        calls mark_commit_enqueued. `held`: the caller counted the node from the placement
        without sending. CopyBeingTrimmedError if the replica cannot count (see
        lua/versions/settle.lua). `counts`: the version's "transfers" and "shards" fields
        if the caller has read its record (they never change once it is created)."""
        (done,) = self.settle_many(vkey, [Settle(shard, replica, node_id, digest, held)], counts)
        if done == -1:
            raise being_trimmed(digest, node_id)
        return bool(done)

    def settle_many(
        self,
        vkey: str,
        settles: Sequence[Settle],
        counts: tuple[str, str] | None = None,
        attempts: Sequence[dict] = (),
        at: float = 0.0,
    ) -> list[int]:
        """Append `attempts` (stamped `at`, as record_attempts) to the attempt log, then
        settle each of `settles` in order (as settle does), in one round trip: the server
        runs them in that order, so whoever sees a settle, and so the commit, sees the
        attempts. Each settle's answer from lua/versions/settle.lua: 1 the set is complete
        and no commit was enqueued yet, 0 otherwise, -1 refused (the copy is being
        trimmed); the caller enqueues the commit and raises for a refusal."""
        v = counts or self.r.hmget(K.VERSION.format(vkey=vkey), "transfers", "shards")
        calls = [_settle_call(vkey, s, v) for s in settles]
        with self.r.pipeline(transaction=False) as p:
            if attempts:
                key = K.ATTEMPTS.format(vkey=vkey)
                p.rpush(key, *(json.dumps({**entry, "at": at}) for entry in attempts))
                p.ltrim(key, -defaults.ATTEMPTS_KEPT, -1)
            for keys, args in calls:
                self._settle.queue_loaded(p, keys, args)
            found = p.execute(raise_on_error=False)
        answers = found[2 if attempts else 0 :]
        for error in found[: len(found) - len(answers)]:
            if isinstance(error, Exception):
                raise error
        out = []
        for (keys, args), answer in zip(calls, answers, strict=True):
            if isinstance(answer, redis.exceptions.NoScriptError):
                # The server does not have the script yet (this client's first settle, or a
                # Redis restart since): sent again the usual way, which loads it. In order:
                # each one came after the attempts, and a refused one changed nothing.
                answer = self._settle(keys=keys, args=args)
            elif isinstance(answer, Exception):
                raise answer
            out.append(int(answer))
        return out

    def mark_commit_enqueued(self, vkey: str) -> None:
        """Record that the commit is queued (only after it is: see lua/versions/settle.lua)."""
        self.r.hset(K.VERSION.format(vkey=vkey), "commit_enqueued", repr(redis_clock(self.r)))

    def reopen_shards(self, vkey: str, shards: list[int]) -> bool:
        """Send the barrier back for `shards` of a pending version (their copies are gone)."""
        plan = self.plan(vkey)
        args = [x for i in shards for x in (i, len(plan[i]))]
        keys = [K.VERSION.format(vkey=vkey), K.SETTLED.format(vkey=vkey), K.READY.format(vkey=vkey)]
        return bool(self._reopen(keys=keys, args=args))

    def barrier_complete(self, vkey: str) -> bool:
        """Every transfer settled and every shard has a verified copy."""
        with self.r.pipeline() as p:
            p.hmget(K.VERSION.format(vkey=vkey), "transfers", "shards")
            p.scard(K.SETTLED.format(vkey=vkey))
            p.scard(K.READY.format(vkey=vkey))
            (transfers, shards), settled, ready = p.execute()
        return settled >= int(transfers or 0) and ready >= int(shards or 0)

    def snapshot(self, vkey: str) -> tuple[dict[str, str], set[str], set[int]]:
        """The version hash, its settled transfers and its ready shards in one consistent
        read (a MULTI block), so a transfer settling in between cannot split them."""
        with self.r.pipeline(transaction=True) as p:
            p.hgetall(K.VERSION.format(vkey=vkey))
            p.smembers(K.SETTLED.format(vkey=vkey))
            p.smembers(K.READY.format(vkey=vkey))
            v, settled, ready = p.execute()
        if not v:
            raise NotFoundError(f"no version {vkey} in the metadata; see `smoltorrent ls`.")
        return v, set(settled), {int(x) for x in ready}

    def progress(self, vkey: str) -> tuple[int, int]:
        """(transfers settled, transfers planned)."""
        return (
            self.r.scard(K.SETTLED.format(vkey=vkey)),
            int(self.r.hget(K.VERSION.format(vkey=vkey), "transfers") or 0),
        )

    def ready_shards(self, vkey: str) -> set[int]:
        return {int(x) for x in self.r.smembers(K.READY.format(vkey=vkey))}

    def settled(self, vkey: str) -> set[str]:
        return set(self.r.smembers(K.SETTLED.format(vkey=vkey)))

    def record_sent(self, vkey: str, sent: Mapping[str, int]) -> None:
        """How far the running transfers of "shard:replica" (a chain feeds all its
        replicas) have got, in bytes, in one round trip."""
        if not sent:
            return
        key = K.SENT.format(vkey=vkey)
        with self.r.pipeline(transaction=False) as p:
            p.hset(key, mapping=dict(sent))
            p.expire(key, defaults.SENT_PROGRESS_TTL_S)
            p.execute()

    def record_wire(self, vkey: str, raw_bytes: int, wire_bytes: int) -> None:
        """Add what one transfer delivered (raw) and put on the wire to the version's total."""
        key = K.WIRE.format(vkey=vkey)
        with self.r.pipeline() as p:
            p.hincrby(key, "raw_bytes", raw_bytes)
            p.hincrby(key, "wire_bytes", wire_bytes)
            p.expire(key, defaults.SENT_PROGRESS_TTL_S)
            p.execute()

    def wire(self, vkey: str) -> tuple[int, int]:
        """(raw bytes, wire bytes) the version's transfers recorded so far."""
        found = self.r.hgetall(K.WIRE.format(vkey=vkey))
        return int(found.get("raw_bytes", 0)), int(found.get("wire_bytes", 0))

    def sent(self, vkey: str) -> dict[str, int]:
        """ "shard:replica" -> bytes sent so far by transfers still running (or just done)."""
        return {k: int(v) for k, v in self.r.hgetall(K.SENT.format(vkey=vkey)).items()}
