"""Placement metadata in Redis: nodes, versions, manifests, placement, dead letters.

Every key comes from coordinator/state/redis_keys.py. Writes that must be atomic
(the commit barrier, the commit flip) are Lua scripts or MULTI blocks, so a
retry, a redelivery or two workers racing leave the same state.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from coordinator.dataplane.node_client import NodeAddress
from coordinator.plan.manifest import Manifest
from coordinator.state import redis_keys as K
from smoltorrent import defaults
from smoltorrent.errors import MetadataError, NotFoundError

PENDING, COMMITTED, ABORTED = "pending", "committed", "aborted"

# Records one settled transfer and says whether it completed the set.
# KEYS: settled, ready, version hash, blob placement
# ARGV: "shard:replica", shard index ("" when the transfer failed), node id,
#       number of transfers, number of shards
_BARRIER = """
redis.call('SADD', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then
  redis.call('SADD', KEYS[2], ARGV[2])
  redis.call('SADD', KEYS[4], ARGV[3])
end
if redis.call('HGET', KEYS[3], 'state') ~= 'pending' then return 0 end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[4])
   and redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[5]) then
  return redis.call('HSETNX', KEYS[3], 'commit_enqueued', '1')
end
return 0
"""


# Marks a version committed and makes it current unless a newer one already is
# (two rewrites of one name can commit out of order).
# KEYS: version hash, current hash; ARGV: name, vkey, now, version-key prefix
_COMMIT = """
redis.call('HSET', KEYS[1], 'state', 'committed', 'committed_at', ARGV[3], 'reason', '')
local current = redis.call('HGET', KEYS[2], ARGV[1])
if current and current ~= ARGV[2] then
  local theirs = tonumber(redis.call('HGET', ARGV[4] .. current, 'created_at') or '0')
  if theirs > tonumber(redis.call('HGET', KEYS[1], 'created_at')) then return 0 end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    address: NodeAddress
    added_at: float


class Metadata:
    def __init__(self, url: str) -> None:
        self.url = url
        self.r = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=defaults.REDIS_TIMEOUT_S,
            socket_connect_timeout=defaults.REDIS_TIMEOUT_S,
        )
        self._barrier = self.r.register_script(_BARRIER)
        self._commit = self.r.register_script(_COMMIT)

    def ping(self) -> None:
        try:
            self.r.ping()
        except redis.RedisError as exc:
            raise MetadataError(
                f"cannot reach Redis at {self.url} ({exc}). Start it, or unset "
                "SMOLTORRENT_REDIS_URL to let smoltorrent run its own."
            ) from exc

    # --- nodes ---------------------------------------------------------------

    def add_node(self, node_id: str, address: NodeAddress) -> None:
        self.r.hset(
            K.NODES, node_id, json.dumps({"address": str(address), "added_at": time.time()})
        )

    def remove_node(self, node_id: str) -> bool:
        self.r.delete(K.NODE_ALIVE.format(node_id=node_id))
        return bool(self.r.hdel(K.NODES, node_id))

    def nodes(self) -> dict[str, NodeRecord]:
        out = {}
        for node_id, raw in self.r.hgetall(K.NODES).items():
            data = json.loads(raw)
            out[node_id] = NodeRecord(node_id, NodeAddress.parse(data["address"]), data["added_at"])
        return out

    def mark_alive(self, node_id: str, stat: dict) -> None:
        self.r.set(
            K.NODE_ALIVE.format(node_id=node_id), json.dumps(stat), ex=defaults.NODE_ALIVE_TTL_S
        )

    def mark_down(self, node_id: str) -> None:
        self.r.delete(K.NODE_ALIVE.format(node_id=node_id))

    def alive(self, node_ids: Iterable[str]) -> dict[str, dict]:
        """Last stat of every node heard from within NODE_ALIVE_TTL_S."""
        ids = list(node_ids)
        if not ids:
            return {}
        raws = self.r.mget([K.NODE_ALIVE.format(node_id=n) for n in ids])
        return {n: json.loads(raw) for n, raw in zip(ids, raws, strict=True) if raw}

    # --- versions ------------------------------------------------------------

    def create_pending(
        self, manifest: Manifest, vkey: str, fields: dict, plan: list[tuple[str, ...]]
    ) -> bool:
        """Record a new pending version; False if it already exists (pending or committed),
        so two stores of the same bytes make one version. An aborted one starts afresh."""
        vk = K.VERSION.format(vkey=vkey)
        with self.r.pipeline() as p:
            while True:
                try:
                    p.watch(vk)
                    if p.hget(vk, "state") in (PENDING, COMMITTED):
                        p.unwatch()
                        return False
                    p.multi()
                    self._write_pending(p, manifest, vkey, fields, plan)
                    p.execute()
                    return True
                except redis.WatchError:
                    continue

    @staticmethod
    def _write_pending(
        p, manifest: Manifest, vkey: str, fields: dict, plan: list[tuple[str, ...]]
    ) -> None:
        vk = K.VERSION.format(vkey=vkey)
        p.delete(
            vk,
            K.PLAN.format(vkey=vkey),
            K.SETTLED.format(vkey=vkey),
            K.READY.format(vkey=vkey),
            K.ATTEMPTS.format(vkey=vkey),
        )
        p.hset(
            vk,
            mapping={
                **{k: str(v) for k, v in fields.items()},
                "name": manifest.name,
                "version_id": manifest.version_id,
                "state": PENDING,
                "size": manifest.source_size,
                "shards": len(manifest.shards),
                "replicas": manifest.replicas,
                "transfers": sum(len(t) for t in plan),
                "created_at": manifest.created_at,
            },
        )
        p.set(K.MANIFEST.format(vkey=vkey), manifest.to_json())
        if plan:
            p.hset(
                K.PLAN.format(vkey=vkey),
                mapping={str(i): json.dumps(list(t)) for i, t in enumerate(plan)},
            )
        p.sadd(K.NAMES, manifest.name)
        p.zadd(K.VERSIONS.format(name=manifest.name), {vkey: manifest.created_at})

    def version(self, vkey: str) -> dict[str, str]:
        data = self.r.hgetall(K.VERSION.format(vkey=vkey))
        if not data:
            raise NotFoundError(
                f"no version {vkey} in the metadata; list them with `smoltorrent ls`."
            )
        return data

    def manifest(self, vkey: str) -> Manifest:
        raw = self.r.get(K.MANIFEST.format(vkey=vkey))
        if raw is None:
            raise NotFoundError(
                f"no manifest for version {vkey}; if Redis was lost, run `smoltorrent rebuild`."
            )
        return Manifest.from_json(raw)

    def plan(self, vkey: str) -> list[tuple[str, ...]]:
        raw = self.r.hgetall(K.PLAN.format(vkey=vkey))
        return [tuple(json.loads(raw[str(i)])) for i in range(len(raw))]

    def set_state(self, vkey: str, state: str, reason: str = "") -> None:
        self.r.hset(K.VERSION.format(vkey=vkey), mapping={"state": state, "reason": reason})

    def claim(self, vkey: str, flag: str) -> bool:
        """Set a one-time flag on a version; True for the single caller that set it."""
        return bool(self.r.hsetnx(K.VERSION.format(vkey=vkey), flag, "1"))

    def record_attempt(self, vkey: str, entry: dict) -> None:
        self.r.rpush(K.ATTEMPTS.format(vkey=vkey), json.dumps({**entry, "at": time.time()}))

    def attempts(self, vkey: str) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(K.ATTEMPTS.format(vkey=vkey), 0, -1)]

    def settle(self, vkey: str, shard: int, replica: int, node_id: str | None, digest: str) -> bool:
        """Record a finished transfer (node_id None when it failed for good); True when this
        call completed the set and the caller must enqueue the commit."""
        v = self.r.hmget(K.VERSION.format(vkey=vkey), "transfers", "shards")
        return bool(
            self._barrier(
                keys=[
                    K.SETTLED.format(vkey=vkey),
                    K.READY.format(vkey=vkey),
                    K.VERSION.format(vkey=vkey),
                    K.PLACEMENT.format(digest=digest),
                ],
                args=[
                    f"{shard}:{replica}",
                    "" if node_id is None else str(shard),
                    node_id or "",
                    v[0] or 0,
                    v[1] or 0,
                ],
            )
        )

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

    def commit(self, vkey: str, name: str) -> bool:
        """Mark a version committed and, unless a newer one is current, flip the name's
        current version to it, atomically; True if it became current."""
        return bool(
            self._commit(
                keys=[K.VERSION.format(vkey=vkey), K.CURRENT],
                args=[name, vkey, time.time(), K.VERSION.format(vkey="")],
            )
        )

    def restore_committed(self, manifest: Manifest, vkey: str) -> bool:
        """Record a version read back from a node's manifest (rebuild); False if known."""
        if self.r.exists(K.VERSION.format(vkey=vkey)):
            return False
        with self.r.pipeline() as p:
            self._write_pending(p, manifest, vkey, {"rebuilt": 1}, [])
            p.hset(
                K.VERSION.format(vkey=vkey),
                mapping={"state": COMMITTED, "committed_at": manifest.created_at},
            )
            p.execute()
        current = self.current(manifest.name)
        if (
            current is None
            or float(self.r.hget(K.VERSION.format(vkey=current), "created_at") or 0)
            < manifest.created_at
        ):
            self.r.hset(K.CURRENT, manifest.name, vkey)
        return True

    def placement(self, digest: str) -> set[str]:
        return set(self.r.smembers(K.PLACEMENT.format(digest=digest)))

    def add_placement(self, digest: str, node_id: str) -> None:
        self.r.sadd(K.PLACEMENT.format(digest=digest), node_id)

    def remove_placement(self, digest: str, node_id: str) -> None:
        self.r.srem(K.PLACEMENT.format(digest=digest), node_id)

    def names(self) -> list[str]:
        return sorted(self.r.smembers(K.NAMES))

    def versions(self, name: str) -> list[str]:
        return list(self.r.zrange(K.VERSIONS.format(name=name), 0, -1))

    def current(self, name: str) -> str | None:
        return self.r.hget(K.CURRENT, name)

    def pending_versions(self) -> list[str]:
        out = []
        for name in self.names():
            for vkey in self.versions(name):
                if self.r.hget(K.VERSION.format(vkey=vkey), "state") == PENDING:
                    out.append(vkey)
        return out

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
        matches = [
            v
            for v in self.versions(name)
            if self.r.hget(K.VERSION.format(vkey=v), "version_id").startswith(version)
        ]
        if len(matches) != 1:
            raise NotFoundError(
                f"{name} has {'no' if not matches else 'several'} versions matching "
                f"'{version}'; see `smoltorrent ls`."
            )
        return matches[0]

    def delete_version(self, vkey: str) -> Manifest | None:
        """Forget a version; returns its manifest so the caller can clean nodes up."""
        data = self.r.hgetall(K.VERSION.format(vkey=vkey))
        if not data:
            return None
        raw = self.r.get(K.MANIFEST.format(vkey=vkey))
        name = data["name"]
        with self.r.pipeline() as p:
            p.delete(
                K.VERSION.format(vkey=vkey),
                K.MANIFEST.format(vkey=vkey),
                K.PLAN.format(vkey=vkey),
                K.SETTLED.format(vkey=vkey),
                K.READY.format(vkey=vkey),
                K.ATTEMPTS.format(vkey=vkey),
            )
            p.zrem(K.VERSIONS.format(name=name), vkey)
            p.execute()
        if self.r.hget(K.CURRENT, name) == vkey:
            rest = [
                v
                for v in self.versions(name)
                if self.r.hget(K.VERSION.format(vkey=v), "state") == COMMITTED
            ]
            if rest:
                self.r.hset(K.CURRENT, name, rest[-1])
            else:
                self.r.hdel(K.CURRENT, name)
        if not self.r.zcard(K.VERSIONS.format(name=name)):
            self.r.srem(K.NAMES, name)
        return Manifest.from_json(raw) if raw else None

    def blob_in_use(self, digest: str) -> bool:
        """Whether any remaining version still references the blob (content addressing)."""
        for name in self.names():
            for vkey in self.versions(name):
                raw = self.r.get(K.MANIFEST.format(vkey=vkey))
                if raw and digest in raw:
                    return True
        return False

    def record_bad_copy(self, digest: str, node_id: str, reason: str) -> None:
        """Note a copy that served wrong bytes, for the integrity sweep to repair."""
        self.r.hset(
            K.BAD_COPIES, f"{digest}:{node_id}", json.dumps({"reason": reason, "at": time.time()})
        )

    # --- dead letters ----------------------------------------------------------

    def add_dead_letter(self, task_id: str, record: dict) -> None:
        with self.r.pipeline() as p:
            p.hset(K.DLQ, task_id, json.dumps({**record, "task_id": task_id, "at": time.time()}))
            p.xadd(K.DLQ_STREAM, {"task_id": task_id}, maxlen=defaults.DLQ_STREAM_MAXLEN)
            p.execute()

    def dead_letters(self) -> list[dict]:
        records = [json.loads(v) for v in self.r.hgetall(K.DLQ).values()]
        return sorted(records, key=lambda r: r["at"])

    def dead_letter(self, task_id: str) -> dict:
        raw = self.r.hget(K.DLQ, task_id)
        if raw is None:
            raise NotFoundError(f"no dead letter {task_id}; list them with `smoltorrent dlq ls`.")
        return json.loads(raw)

    def has_dead_letter(self, task_id: str) -> bool:
        return bool(self.r.hexists(K.DLQ, task_id))

    def remove_dead_letter(self, task_id: str) -> None:
        self.r.hdel(K.DLQ, task_id)

    def dead_letter_depth(self) -> int:
        return self.r.hlen(K.DLQ)
