"""Dead letters: tasks that failed for good, kept with their arguments for `dlq ls` and a
replay, and indexed by the version they work on so a remove drops them without reading
the whole queue."""

from __future__ import annotations

import json
import re
import time

import redis

from coordinator.state import redis_keys as K
from smoltorrent import defaults
from smoltorrent.errors import NotFoundError

_HEX = re.compile("[0-9a-f]+")


def _vkey_of_task(task_id: str) -> str | None:
    """The version a task works on, from its id ("transfer-<vkey>-...", see tasks/enqueue.py)."""
    parts = task_id.split("-")
    if len(parts) > 1 and len(parts[1]) == 32 and _HEX.fullmatch(parts[1]):
        return parts[1]
    return None


class DeadLetters:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def add_dead_letter(self, task_id: str, record: dict) -> None:
        vkey = (record.get("kwargs") or {}).get("vkey") or _vkey_of_task(task_id)
        with self.r.pipeline() as p:
            p.hset(K.DLQ, task_id, json.dumps({**record, "task_id": task_id, "at": time.time()}))
            p.xadd(K.DLQ_STREAM, {"task_id": task_id}, maxlen=defaults.DLQ_STREAM_MAXLEN)
            if vkey:
                p.sadd(K.DLQ_OF.format(vkey=vkey), task_id)
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
        raw = self.r.hget(K.DLQ, task_id)
        vkey = _vkey_of_task(task_id)
        if raw is not None:
            vkey = (json.loads(raw).get("kwargs") or {}).get("vkey") or vkey
        with self.r.pipeline() as p:
            p.hdel(K.DLQ, task_id)
            if vkey:
                p.srem(K.DLQ_OF.format(vkey=vkey), task_id)
            p.execute()

    def drop_dead_letters_of(self, vkey: str) -> int:
        """Forget the dead letters of a removed version (nothing left to replay them for):
        those its index lists, without reading the rest of the queue."""
        key = K.DLQ_OF.format(vkey=vkey)
        ids = list(self.r.smembers(key))
        dropped = self.r.hdel(K.DLQ, *ids) if ids else 0
        self.r.delete(key)
        return dropped

    def prune(self, older_than_s: float, now: float | None = None) -> int:
        """Forget the dead letters recorded more than `older_than_s` ago (their version
        indexes too); how many. Read in pages, so a long queue is never one reply."""
        cutoff = (time.time() if now is None else now) - older_than_s
        old: list[tuple[str, str | None]] = []
        for task_id, raw in self.r.hscan_iter(K.DLQ, count=500):
            record = json.loads(raw)
            if record.get("at", 0) < cutoff:
                vkey = (record.get("kwargs") or {}).get("vkey") or _vkey_of_task(task_id)
                old.append((task_id, vkey))
        with self.r.pipeline() as p:
            for task_id, vkey in old:
                p.hdel(K.DLQ, task_id)
                if vkey:
                    p.srem(K.DLQ_OF.format(vkey=vkey), task_id)
            p.execute()
        return len(old)

    def dead_letter_depth(self) -> int:
        return self.r.hlen(K.DLQ)
