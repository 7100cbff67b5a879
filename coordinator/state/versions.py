"""Versions: their records and states, each name's current version and its request order.

A version moves only by a compare-and-set script (lua/versions/, lua/removals/):
    pending -> committed | aborted;  committed | pending | aborted -> removing -> removed.
Nothing ever moves committed -> aborted, and nothing leaves removing except to removed.
A name's versions are ordered by the sequence number of their latest request (never by
wall clocks); the current one is the committed version of the latest request.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Iterable, Iterator, Sequence

import redis

from coordinator.plan.manifest import Manifest, VersionBlobs
from coordinator.state import redis_keys as K
from coordinator.state.requests import next_seq
from coordinator.state.scripts import load
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError

PENDING, COMMITTED, ABORTED = "pending", "committed", "aborted"
REMOVING, REMOVED = "removing", "removed"


def version_keys(vkey: str) -> list[str]:
    """version, manifest, plan, settled, ready, attempts: every per-version key a create or
    a finished remove replaces."""
    return [
        K.VERSION.format(vkey=vkey),
        K.MANIFEST.format(vkey=vkey),
        K.PLAN.format(vkey=vkey),
        K.SETTLED.format(vkey=vkey),
        K.READY.format(vkey=vkey),
        K.ATTEMPTS.format(vkey=vkey),
    ]


def digests(manifest: Manifest) -> list[str]:
    """Each distinct blob of a manifest once, in shard (or chunk) order."""
    return list(dict.fromkeys(s.blob_sha256 for s in manifest.entries))


def listing_row(manifest: Manifest, transfers: int, tensors: int | None = None) -> str:
    """The fields `ls` shows of a version that never change once it is recorded (JSON, name
    first and digests last: lua/listing/slice.lua finds them there without decoding it).
    `tensors`: manifest.tensor_count() when the caller has it (a chunked manifest's count
    parses its whole header)."""
    return json.dumps(
        {
            "name": manifest.name,
            "version_id": manifest.version_id,
            "size": manifest.source_size,
            "shards": len(manifest.entries),
            "tensors": manifest.tensor_count() if tensors is None else tensors,
            "replicas": manifest.replicas,
            "transfers": transfers,
            "created_at": manifest.created_at,
            "digests": [s.blob_sha256 for s in manifest.entries],
        },
        separators=(",", ":"),
    )


def _plan_json(plan: Sequence[Sequence[str]]) -> str:
    """The plan as the create script takes it: a JSON list of each entry's node list as
    JSON text. Entries with the same nodes share one text: a few node orders for
    thousands of chunks, not a string each beside the store's own objects. An entry may
    be a list (chain_order's) as well as a tuple."""
    texts: dict[tuple[str, ...], str] = {}

    def text(nodes: Sequence[str]) -> str:
        key = tuple(nodes)
        return texts.get(key) or texts.setdefault(key, json.dumps(list(key)))

    return json.dumps([text(nodes) for nodes in plan])


class Versions:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        # vkey -> ((its committed_at, replicas), its parsed blobs): see committed_blobs
        self._parsed: dict[str, tuple[tuple, VersionBlobs]] = {}
        self._create = load(r, "versions/create")
        self._commit = load(r, "versions/commit")
        self._abort = load(r, "versions/abort")
        self._pin = load(r, "versions/pin")
        self._tag = load(r, "versions/tag")

    def create_pending(
        self,
        manifest: Manifest,
        vkey: str,
        fields: dict,
        plan: list[tuple[str, ...]],
        seq: int | None = None,
        tensors: int | None = None,
    ) -> str:
        """Record the version a store request asks for, ordered by the request's sequence
        number (a fresh one if not given). Returns "created" for a new pending version
        (also over an aborted or removed one), else the state of the existing version it
        joined: "pending", "committed" (made current again if this request is the latest
        for the name) or "removing" (the caller waits for the remove to finish).
        `tensors`: the source's tensor count when the caller has it (the store counted it
        at plan time), for the listing row."""
        if seq is None:
            seq = next_seq(self.r)
        stale = self._aborted_blobs(vkey)
        while True:
            staged, _ = self._stage(manifest, vkey)
            keys, args = self._create_call(
                manifest, vkey, fields, plan, seq, tensors, staged, stale
            )
            found = self._create(keys=keys, args=args)
            if found != "unstaged":  # else it expired before the script ran: stage it again
                return found

    def _create_call(
        self,
        manifest: Manifest,
        vkey: str,
        fields: dict,
        plan: list[tuple[str, ...]],
        seq: int,
        tensors: int | None,
        staged: str,
        stale: Sequence[str] = (),
    ) -> tuple[list[str], list]:
        """The keys and arguments of the create script for create_pending. `stale`: the
        blobs an aborted version of vkey references (_aborted_blobs), which lose it if the
        script records the version anew."""
        transfers = sum(len(t) for t in plan)
        fresh = digests(manifest)
        keys = [
            *version_keys(vkey),
            K.NAMES,
            K.VERSIONS.format(name=manifest.name),
            K.CURRENT,
            K.CURRENT_SEQ,
            K.VERSION_ROWS,
            K.VERSION_STATES,
            K.ALL_VERSIONS,
            K.SUMMARIES_FILLED,
            staged,
            *(K.BLOB_REFS.format(digest=d) for d in fresh),
            *(K.BLOB_REFS.format(digest=d) for d in stale),
        ]
        args = [
            seq,
            manifest.name,
            vkey,
            json.dumps(
                {
                    **{k: str(v) for k, v in fields.items()},
                    "name": manifest.name,
                    "version_id": manifest.version_id,
                    "size": str(manifest.source_size),
                    "shards": str(len(manifest.entries)),
                    "replicas": str(manifest.replicas),
                    "transfers": str(transfers),
                    "created_at": repr(manifest.created_at),
                }
            ),
            _plan_json(plan),
            listing_row(manifest, transfers, tensors),
            len(fresh),
        ]
        return keys, args

    def _aborted_blobs(self, vkey: str) -> list[str]:
        """The blobs the recorded manifest of vkey references while vkey is aborted (an
        aborted version keeps its references until retention removes it), else []. A store
        of the same content recording it anew may make other blobs of it (another
        encoding): the create script then takes vkey out of these, which no remove would
        (it reads the new manifest)."""
        if self.r.hget(K.VERSION.format(vkey=vkey), "state") != ABORTED:
            return []
        try:
            return digests(self.manifest(vkey))
        except NotFoundError:
            return []

    def _stage(
        self, manifest: Manifest, vkey: str, client: redis.client.Pipeline | None = None
    ) -> tuple[str, int]:
        """Write the manifest's JSON to a key of its own (MANIFEST_STAGED, fresh for this
        call), MANIFEST_PIECE_BYTES a round trip (or a command queued on `client`); its key
        and the bytes written. The create script renames it to the version's manifest,
        whole. Sent as the script's
        argument, a 16 GB checkpoint's 2 MB manifest was held at once beside the rest of
        its ~5 MB of arguments. A store that dies before the script leaves it unread, and
        it expires."""
        staged = K.MANIFEST_STAGED.format(vkey=vkey, token=secrets.token_hex(8))
        written = 0
        to = self.r if client is None else client

        def send(piece: bytes) -> None:
            nonlocal written
            if written:
                to.append(staged, piece)
            else:
                to.set(staged, piece, ex=defaults.MANIFEST_STAGED_TTL_S)
            written += len(piece)

        manifest.write_json_pieces(send, defaults.MANIFEST_PIECE_BYTES)
        return staged, written

    def note_manifest_nodes(self, vkey: str, node_ids: Iterable[str]) -> None:
        """Record that `node_ids` are sent a copy of `vkey`'s manifest, before it is put
        there: a remove waits for each of them (manifest_nodes), whatever blobs they hold
        by then. A copy recorded and never put costs a remove one delete of nothing."""
        node_ids = list(node_ids)
        if node_ids:
            self.r.sadd(K.MANIFEST_NODES.format(vkey=vkey), *node_ids)

    def note_manifests_held(self, node_id: str, vkeys: Sequence[str]) -> None:
        """`node_id` was found holding a copy of each of `vkeys`' manifests (a rebuild, the
        crosscheck), LISTING_BATCH_VERSIONS a round trip."""
        for start in range(0, len(vkeys), defaults.LISTING_BATCH_VERSIONS):
            with self.r.pipeline(transaction=False) as p:
                for vkey in vkeys[start : start + defaults.LISTING_BATCH_VERSIONS]:
                    p.sadd(K.MANIFEST_NODES.format(vkey=vkey), node_id)
                p.execute()

    def manifest_nodes(self, vkey: str) -> set[str]:
        """The nodes that were sent, or found holding, a copy of `vkey`'s manifest."""
        return set(self.r.smembers(K.MANIFEST_NODES.format(vkey=vkey)))

    def version(self, vkey: str) -> dict[str, str]:
        data = self.r.hgetall(K.VERSION.format(vkey=vkey))
        if not data:
            raise NotFoundError(
                f"no version {vkey} in the metadata; list them with `smoltorrent ls`."
            )
        return data

    def manifest(self, vkey: str) -> Manifest:
        key = K.MANIFEST.format(vkey=vkey)
        if self.r.strlen(key) > defaults.MANIFEST_PIECE_BYTES:
            manifest = self._manifest_in_pieces(key)
            if manifest is not None:
                return manifest
        # Held in a list the parse takes it from: the reply is freed once decoded.
        held = [self.r.get(key)]
        if held[0] is None:
            raise NotFoundError(
                f"no manifest for version {vkey}; if Redis was lost, run `smoltorrent rebuild`."
            )
        return Manifest.from_json_taken(held)

    def _manifest_in_pieces(self, key: str) -> Manifest | None:
        """The manifest at `key` read MANIFEST_PIECE_BYTES a round trip and parsed as
        the pieces come (Manifest.from_json_pieces): the whole reply took three times its
        2 MB at once (redis-py's read buffer, the bytes, the text) for a 16 GB checkpoint,
        before its parse (bench/RESULTS.md, memflat5). Read again if it changed meanwhile
        (WATCH); None when it is gone or not in to_json's form (read it whole, which says
        what is wrong)."""
        while True:
            with self.r.pipeline() as p:
                try:
                    p.watch(key)
                    pieces = self._pieces(p, key, p.strlen(key))
                    try:
                        return Manifest.from_json_pieces(pieces)
                    except UnicodeDecodeError:  # a piece cut a character: not to_json's
                        return None
                    finally:
                        p.multi()
                        p.execute()  # WatchError if it changed while read
                except redis.WatchError:
                    continue

    @staticmethod
    def _pieces(p: redis.client.Pipeline, key: str, size: int) -> Iterator[str]:
        """The text of `key` (`size` bytes), MANIFEST_PIECE_BYTES a GETRANGE, as they
        are asked for."""
        piece = defaults.MANIFEST_PIECE_BYTES
        for start in range(0, size, piece):
            yield p.getrange(key, start, start + piece - 1)

    def _each(self, vkeys: list[str], ask) -> list:
        """ask(pipeline, vkey) queued for every vkey, one round trip per
        LISTING_BATCH_VERSIONS, not per version: the replies in order."""
        out: list = []
        batch = defaults.LISTING_BATCH_VERSIONS
        for start in range(0, len(vkeys), batch):
            with self.r.pipeline(transaction=False) as p:
                for vkey in vkeys[start : start + batch]:
                    ask(p, vkey)
                out += p.execute()
        return out

    def version_blobs(self, vkeys: Iterable[str]) -> dict[str, VersionBlobs]:
        """vkey -> its name, replicas and blobs (from its manifest), for those of `vkeys`
        that have one (a version removed meanwhile is left out): one round trip per
        LISTING_BATCH_VERSIONS, not per version."""
        vkeys = list(vkeys)
        raws = self._each(vkeys, lambda p, vkey: p.get(K.MANIFEST.format(vkey=vkey)))
        return {
            vkey: VersionBlobs.from_json(raw)
            for vkey, raw in zip(vkeys, raws, strict=True)
            if raw is not None
        }

    def committed_blobs(self, vkeys: Iterable[str]) -> dict[str, VersionBlobs]:
        """version_blobs of committed versions, each manifest read and parsed once per
        client while its commit stands: the repair sweep runs every 30 s over every
        committed version, and parsed them all each time. A version's committed_at (one
        short reply each, batched) says whether the parse kept is still its own: a commit
        again (a rollback, the version removed and stored again) reads it afresh. Versions
        not in `vkeys` leave the cache."""
        vkeys = list(vkeys)
        # Its R too: `store --replicas` on stored content changes it in place (set_replicas).
        stamps = self._each(
            vkeys, lambda p, v: p.hmget(K.VERSION.format(vkey=v), "committed_at", "replicas")
        )
        stamped = {v: tuple(at) for v, at in zip(vkeys, stamps, strict=True) if at[0] is not None}
        stale = [v for v, at in stamped.items() if self._parsed.get(v, (None,))[0] != at]
        fresh = self.version_blobs(stale)
        self._parsed = {
            v: (at, fresh[v]) if v in fresh else self._parsed[v]
            for v, at in stamped.items()
            if v in fresh or v not in stale
        }
        return {v: self._parsed[v][1] for v in vkeys if v in self._parsed}

    def set_replicas(self, vkey: str, replicas: int) -> int | None:
        """Record that committed version `vkey` asks for `replicas` copies of each blob (a
        store of its bytes again with another --replicas): its record, its manifest and
        its listing row, in one transaction. The repair sweep copies each blob up to, or
        trims it down to, the most any version using it asks for; the nodes' copies of the
        manifest are the caller's to write. The R it asked for before, or None when it is
        not committed (nothing changed).

        R is one of the version's marks (coordinator/state/marks.py): the change takes a
        fresh marks_seq, so of the nodes' copies a rebuild reads, the one written after it
        says R. The store request that asked for it had put copies with the old R at the
        same request number; a holder down in between kept one, and a rebuild that read it
        first brought the old R back."""
        version, manifest_key = K.VERSION.format(vkey=vkey), K.MANIFEST.format(vkey=vkey)

        def change(p: redis.client.Pipeline) -> int | None:
            state, before = p.hmget(version, "state", "replicas")
            raw, row = p.get(manifest_key), p.hget(K.VERSION_ROWS, vkey)
            if state != COMMITTED or raw is None:
                return None
            manifest = dataclasses.replace(Manifest.from_json(raw), replicas=replicas)
            marks_seq = next_seq(self.r)
            p.multi()
            p.hset(version, mapping={"replicas": replicas, "marks_seq": marks_seq})
            p.set(manifest_key, manifest.to_json())
            if row is not None:
                p.hset(K.VERSION_ROWS, vkey, json.dumps({**json.loads(row), "replicas": replicas},
                                                        separators=(",", ":")))  # fmt: skip
            return int(before or manifest.replicas)

        return self.r.transaction(
            change, version, manifest_key, K.VERSION_ROWS, value_from_callable=True
        )

    def state(self, vkey: str) -> str | None:
        return self.r.hget(K.VERSION.format(vkey=vkey), "state")

    def states(self, vkeys: Sequence[str]) -> list[str | None]:
        """state() of each of `vkeys`, in order: one round trip per LISTING_BATCH_VERSIONS
        (the crosscheck asks of every manifest on every node)."""
        return self._each(list(vkeys), lambda p, v: p.hget(K.VERSION.format(vkey=v), "state"))

    def abort(self, vkey: str, reason: str) -> bool:
        """pending -> aborted; True if this call aborted it (a committed version stays)."""
        aborted = bool(
            self._abort(keys=[K.VERSION.format(vkey=vkey), K.VERSION_STATES], args=[reason, vkey])
        )
        if aborted:  # no transfer of it runs now (a store of it again keeps them afresh)
            self.r.delete(K.SPANS.format(vkey=vkey))
        return aborted

    def claim(self, vkey: str, flag: str) -> bool:
        """Set a one-time flag on a version; True for the single caller that set it."""
        return bool(self.r.hsetnx(K.VERSION.format(vkey=vkey), flag, "1"))

    def commit(self, vkey: str, name: str) -> bool:
        """pending -> committed, and current unless a later request's version already is;
        True if it is current now. A version aborted or being removed stays as it is."""
        state, current = self._commit(
            keys=[K.VERSION.format(vkey=vkey), K.CURRENT, K.CURRENT_SEQ, K.VERSION_STATES],
            args=[name, vkey, time.time()],
        )
        if state == COMMITTED:  # its attempt log is history now: kept a while, then gone
            with self.r.pipeline(transaction=False) as p:
                p.expire(K.ATTEMPTS.format(vkey=vkey), defaults.ATTEMPTS_TTL_S)
                p.delete(K.SPANS.format(vkey=vkey))
                p.execute()
        return bool(current)

    def restore_committed(self, manifest: Manifest, vkey: str) -> bool:
        """Record a version read back from a node's manifest (rebuild); False if Redis
        knows it already, in any state (a removing or removed one is never brought back).
        Rebuild calls this oldest first, so sequence numbers keep their order."""
        return self.restore_committed_many([(manifest, vkey, None)])[0]

    def restore_committed_many(
        self, restores: Sequence[tuple[Manifest, str, int | None]]
    ) -> list[bool]:
        """restore_committed of each (manifest, vkey, its tensor count) in turn, as the same
        steps but each queued for every version at once: a round trip for which are known,
        one for their sequence numbers, a pipeline of stage and create scripts
        (REBUILD_PIPELINE_BYTES of manifests each at most), one of commits, one of their
        clean-up. Five round trips a version were most of a rebuild's time at 10,000
        versions (docs/benchmarks.md). Rebuild passes at most REBUILD_BATCH_VERSIONS."""
        with self.r.pipeline(transaction=False) as p:
            for _, vkey, _ in restores:
                p.exists(K.VERSION.format(vkey=vkey))
            known = p.execute()
        new = [item for item, found in zip(restores, known, strict=True) if not found]
        if not new:
            return [False] * len(restores)
        # One number each, in order, as next_seq gives them one at a time.
        first = int(self.r.incrby(K.SEQ, len(new))) - len(new) + 1
        found: list[str] = []
        at: list[int] = []  # where each queued create's answer is among its pipeline's
        queued = 0
        with self.r.pipeline(transaction=False) as p:
            for n, (manifest, vkey, tensors) in enumerate(new):
                staged, written = self._stage(manifest, vkey, p)
                keys, args = self._create_call(
                    manifest, vkey, {"rebuilt": 1}, [], first + n, tensors, staged
                )
                self._create(keys=keys, args=args, client=p)
                at.append(len(p) - 1)
                queued += written
                if queued >= defaults.REBUILD_PIPELINE_BYTES or n == len(new) - 1:
                    answers = p.execute()
                    found.extend(answers[i] for i in at)
                    at, queued = [], 0
        created = []
        for n, ((manifest, vkey, tensors), state) in enumerate(zip(new, found, strict=True)):
            if state == "unstaged":  # expired before its script ran: alone, as create_pending
                state = self.create_pending(manifest, vkey, {"rebuilt": 1}, [], first + n, tensors)
            if state == "created":
                created.append((manifest, vkey))
        if created:
            with self.r.pipeline(transaction=False) as p:
                for manifest, vkey in created:
                    version = K.VERSION.format(vkey=vkey)
                    self._commit(
                        keys=[version, K.CURRENT, K.CURRENT_SEQ, K.VERSION_STATES],
                        args=[manifest.name, vkey, time.time()],
                        client=p,
                    )
                states = p.execute()
            with self.r.pipeline(transaction=False) as p:
                for (_, vkey), (state, _) in zip(created, states, strict=True):
                    if state == COMMITTED:  # as commit: its attempt log kept a while
                        p.expire(K.ATTEMPTS.format(vkey=vkey), defaults.ATTEMPTS_TTL_S)
                        p.delete(K.SPANS.format(vkey=vkey))
                p.execute()
        restored = {vkey for _, vkey in created}
        return [vkey in restored for _, vkey, _ in restores]

    def names(self) -> list[str]:
        return sorted(self.r.smembers(K.NAMES))

    def has_name(self, name: str) -> bool:
        return bool(self.r.sismember(K.NAMES, name))

    def versions(self, name: str) -> list[str]:
        """The vkeys of `name`, in request order."""
        return list(self.r.zrange(K.VERSIONS.format(name=name), 0, -1))

    def current(self, name: str) -> str | None:
        return self.r.hget(K.CURRENT, name)

    def pin(self, vkey: str) -> str:
        """Keep a committed version from retention; the state found (pinned only if it is
        "committed")."""
        return self._pin(keys=[K.VERSION.format(vkey=vkey), K.PINS], args=[vkey, time.time()])

    def unpin(self, vkey: str) -> bool:
        """True if it was pinned."""
        return bool(self.r.hdel(K.PINS, vkey))

    def tag(self, vkey: str, name: str, label: str) -> str:
        """Give a committed version of `name` the label `label`, taking it from any other
        version of `name`; the state found (labelled only if it is "committed")."""
        return self._tag(
            keys=[K.VERSION.format(vkey=vkey), K.VERSIONS.format(name=name), K.TAGS],
            args=[vkey, label],
        )

    def untag(self, vkey: str, label: str) -> bool:
        """Take `label` off a version; True if it had it."""
        labels = (self.r.hget(K.TAGS, vkey) or "").split()
        if label not in labels:
            return False
        kept = " ".join(item for item in labels if item != label)
        if kept:
            self.r.hset(K.TAGS, vkey, kept)
        else:
            self.r.hdel(K.TAGS, vkey)
        return True

    def labels(self, vkeys: list[str]) -> dict[str, tuple[bool, list[str]]]:
        """vkey -> (pinned, its labels), for these versions: one round trip."""
        if not vkeys:
            return {}
        with self.r.pipeline(transaction=False) as p:
            p.hmget(K.PINS, vkeys)
            p.hmget(K.TAGS, vkeys)
            pins, tags = p.execute()
        return {
            v: (pin is not None, (tag or "").split())
            for v, pin, tag in zip(vkeys, pins, tags, strict=True)
        }

    def with_label(self, name: str, label: str) -> str:
        """vkey of the version of `name` labelled `label` (NotFoundError if none)."""
        vkeys = self.versions(name)
        for vkey, (_, labels) in self.labels(vkeys).items():
            if label in labels:
                return vkey
        raise NotFoundError(
            f"no version of {name} is tagged {label!r}; `smoltorrent ls {name}` shows its"
            " versions and tags"
        )

    def split_at(self, name: str) -> tuple[str, str | None]:
        """`NAME@LABEL` or `NAME@VERSION` (a version-id prefix) as (NAME, the version id it
        names); any other name as (name, None). A stored name holding "@" is that name; a
        label is looked for before a version id."""
        if "@" not in name or self.has_name(name):
            return name, None
        base, _, after = name.rpartition("@")
        try:
            vkey = self.with_label(base, after)
        except NotFoundError:
            if not after or any(c not in "0123456789abcdef" for c in after):
                raise
            vkey = self.resolve(base, after)
        return base, self.version(vkey)["version_id"]

    def resolve(self, name: str, version: str | None = None) -> str:
        """vkey of `name` at `version` (a version-id prefix), or its current version."""
        if version is None:
            vkey = self.current(name)
            if vkey is None:
                known = self.versions(name)
                raise NotFoundError(
                    f"{name} has no committed version"
                    + (
                        f" ({len(known)} pending or aborted; see `smoltorrent ls`)."
                        if known
                        else "; list stored checkpoints with `smoltorrent ls`."
                    )
                )
            return vkey
        vkeys = self.versions(name)
        with self.r.pipeline(transaction=False) as p:
            for v in vkeys:
                p.hget(K.VERSION.format(vkey=v), "version_id")
            ids = p.execute()
        matches = [v for v, i in zip(vkeys, ids, strict=True) if (i or "").startswith(version)]
        if len(matches) != 1:
            raise NotFoundError(
                f"{name} has {'no' if not matches else 'several'} versions matching "
                f"'{version}'; see `smoltorrent ls`."
            )
        return matches[0]
