"""Steps of per-rank sharded checkpoints: which rank's checkpoint makes up which step,
and the step's commit marker, in Redis (its scripts: lua/steps/).

Each rank's part of a step is an ordinary checkpoint (its own name, versions and
manifest). A step is a hash: its world size, its state and, per rank, the version
that rank stored. It moves pending -> committed in the same Lua script that records
the last rank's part, so it is complete for every reader at once or for none; a
reader ignores anything not committed (torchsnapshot's marker-last rule). While a step
is pending, each rank's writer marks when it began its part (`begun:R`), beats while it
stores it (`beat:R`, every STEP_BEAT_S) and records a failure for good (`failed:R`), so
that a reader tells a part still in flight from one abandoned (failed, or its writer
silent past STEP_STALE_S: it died). A step is
only ever marked removing once it is committed and older than the K newest, and a
pending step (a save in flight, or one a crash left behind) is never removed by
keep-last-K: only `remove_step` does that.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from coordinator.state import redis_keys as K
from coordinator.state.scripts import load

PENDING = "pending"
COMMITTED = "committed"
REMOVING = "removing"

_RANK = "rank:"  # hash field prefix of one rank's part
_BEGUN = "begun:"  # ... of when a rank's writer began storing its part (unix s)
_BEAT = "beat:"  # ... of the last heartbeat of that writer (unix s)
_FAILED = "failed:"  # ... of its failure for good: {"at", "error"}, JSON

# Metadata keys each rank's part carries in its own safetensors header, so the nodes
# alone say which step it belongs to (rebuild restores steps from them).
STEP_NAME_KEY = "smoltorrent.name"
STEP_KEY = "smoltorrent.step"
RANK_KEY = "smoltorrent.rank"
WORLD_SIZE_KEY = "smoltorrent.world_size"


@dataclass(frozen=True)
class Part:
    """One rank's checkpoint in a step."""

    rank: int
    name: str
    vkey: str
    version_id: str
    size: int


@dataclass(frozen=True)
class Step:
    name: str
    step: int
    world_size: int
    state: str
    parts: dict[int, Part]
    created_at: float
    begun: dict[int, float] = field(default_factory=dict)  # rank -> when its part began
    beats: dict[int, float] = field(default_factory=dict)  # rank -> its writer's last beat
    failed: dict[int, tuple[float, str]] = field(default_factory=dict)  # rank -> (when, why)


class Steps:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._begin = load(r, "steps/begin")
        self._complete = load(r, "steps/complete")
        self._mark_removing = load(r, "steps/mark_removing")
        self._beat = load(r, "steps/beat")
        self._fail = load(r, "steps/fail")

    def begin(self, name: str, step: int, world_size: int, rank: int | None = None) -> list[str]:
        """Open the step (or join it): ["ok"], ["world_size", theirs] or ["state", state].
        With `rank`, that rank's part is marked begun (and alive) now."""
        return self._begin(
            keys=[K.STEP.format(name=name, step=step), K.STEPS.format(name=name)],
            args=[step, world_size, time.time(), "" if rank is None else rank],
        )

    def beat(self, name: str, step: int, rank: int) -> bool:
        """The rank's writer is still storing its part; False once the step is not pending."""
        return bool(
            self._beat(keys=[K.STEP.format(name=name, step=step)], args=[rank, time.time()])
        )

    def fail(self, name: str, step: int, rank: int, error: str) -> bool:
        """The rank's part failed for good; False once the step is not pending."""
        failure = json.dumps({"at": time.time(), "error": error})
        return bool(self._fail(keys=[K.STEP.format(name=name, step=step)], args=[rank, failure]))

    def complete(self, name: str, step: int, world_size: int, part: Part) -> list[str]:
        """Record a rank's stored part: ["committed"] when it was the last one, ["pending"],
        or the conflict as begin() reports it."""
        record = {k: v for k, v in vars(part).items() if k != "rank"}
        return self._complete(
            keys=[K.STEP.format(name=name, step=step)],
            args=[part.rank, world_size, json.dumps(record, sort_keys=True), time.time()],
        )

    def get(self, name: str, step: int) -> Step | None:
        raw = self.r.hgetall(K.STEP.format(name=name, step=step))
        if not raw:
            return None
        parts = {
            int(field[len(_RANK) :]): Part(rank=int(field[len(_RANK) :]), **json.loads(value))
            for field, value in raw.items()
            if field.startswith(_RANK)
        }

        def per_rank(prefix: str) -> dict[int, str]:
            return {int(f[len(prefix) :]): v for f, v in raw.items() if f.startswith(prefix)}

        failed = {r: json.loads(v) for r, v in per_rank(_FAILED).items()}
        return Step(
            name=name,
            step=step,
            world_size=int(raw["world_size"]),
            state=raw["state"],
            parts=parts,
            created_at=float(raw["created_at"]),
            begun={r: float(v) for r, v in per_rank(_BEGUN).items()},
            beats={r: float(v) for r, v in per_rank(_BEAT).items()},
            failed={r: (float(f["at"]), str(f["error"])) for r, f in failed.items()},
        )

    def all(self, name: str) -> list[Step]:
        """Every step of `name` still recorded, oldest first."""
        steps = (self.get(name, int(s)) for s in self.r.zrange(K.STEPS.format(name=name), 0, -1))
        return [s for s in steps if s is not None]

    def latest(self, name: str, world_size: int | None = None) -> int | None:
        """The newest committed step (of `world_size` ranks, when given)."""
        for raw in self.r.zrevrange(K.STEPS.format(name=name), 0, -1):
            state, ws = self.r.hmget(K.STEP.format(name=name, step=raw), "state", "world_size")
            if state == COMMITTED and (world_size is None or int(ws) == world_size):
                return int(raw)
        return None

    def restore(self, name: str, step: int, world_size: int, parts: list[Part]) -> bool:
        """Record a committed step read back from its parts' manifests (rebuild); False if
        Redis knows the step already, in any state."""
        key = K.STEP.format(name=name, step=step)
        if self.r.exists(key):
            return False
        now = time.time()
        fields = {
            _RANK + str(p.rank): json.dumps(
                {k: v for k, v in vars(p).items() if k != "rank"}, sort_keys=True
            )
            for p in parts
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            key,
            mapping={
                "world_size": world_size,
                "state": COMMITTED,
                "parts": len(parts),
                "created_at": now,
                "committed_at": now,
                "rebuilt": 1,
                **fields,
            },
        )
        pipe.zadd(K.STEPS.format(name=name), {str(step): step})
        pipe.execute()
        return True

    def mark_removing(self, name: str, step: int) -> bool:
        """committed -> removing: no reader takes the step from here on."""
        return bool(self._mark_removing(keys=[K.STEP.format(name=name, step=step)]))

    def forget(self, name: str, step: int) -> None:
        """Drop the step's record (its parts' versions are removed first)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(K.STEP.format(name=name, step=step))
        pipe.zrem(K.STEPS.format(name=name), step)
        pipe.execute()
