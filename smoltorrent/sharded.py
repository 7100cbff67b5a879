"""Per-rank sharded checkpoints: every rank saves its own part of a step, and a step
is resumed only once every rank's part is stored.

    smoltorrent.save_sharded(model.state_dict(), "run1", step, rank, world_size)
    ...
    step = smoltorrent.latest_step("run1")
    state = smoltorrent.load_sharded("run1", step, rank, world_size)

A rank's part is an ordinary checkpoint named `NAME/step-SSSSSSSS/rank-RRRRR-of-WWWWW
.safetensors`, stored through save() (wait=False works the same). Once a part is
committed, its version is recorded in the step's Redis hash (coordinator/state/
steps.py); the rank that records the last part commits the step in the same script.
load_sharded refuses, each with its own error under ShardedCheckpointError: a world
size other than the step's (WorldSizeMismatchError), a step not every rank finished
(PartialStepError), a committed step one of whose parts is gone (MissingRankError).
A saved part's version id (a SHA-256 over its header and blob digests) is the rank's
digest; loading it verifies every byte against the blob digests.

keep_last=K (on any rank; the rank that commits a step applies it) removes the
committed steps older than the K newest once the new step is committed, never before;
steps still pending (a save in flight) are never touched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator.plan.manifest import storage_key
from coordinator.state.steps import (
    COMMITTED,
    PENDING,
    RANK_KEY,
    REMOVING,
    STEP_KEY,
    STEP_NAME_KEY,
    WORLD_SIZE_KEY,
    Part,
    Steps,
)
from coordinator.state.versions import COMMITTED as VERSION_COMMITTED
from coordinator.state.versions import REMOVED
from smoltorrent import defaults
from smoltorrent.api import SavedVersion, SaveHandle, load, start_save
from smoltorrent.errors import (
    MissingRankError,
    PartialStepError,
    ShardedCheckpointError,
    StepNotFoundError,
    WorldSizeMismatchError,
)
from tasks.requests import connected_metadata, submit_remove


def part_name(name: str, step: int, rank: int, world_size: int) -> str:
    """The checkpoint name of one rank's part of a step."""
    return f"{name}/step-{step:08d}/rank-{rank:05d}-of-{world_size:05d}.safetensors"


def _check(step: int, rank: int, world_size: int) -> None:
    for label, value in (("step", step), ("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ShardedCheckpointError(f"{label} must be an integer >= 0, not {value!r}")
    if world_size < 1 or rank >= world_size:
        raise ShardedCheckpointError(
            f"rank {rank} is outside world size {world_size} (ranks are 0..world_size-1)"
        )


def _steps() -> Steps:
    return Steps(connected_metadata().r)


def save_sharded(
    state_dict: Mapping[str, Any],
    name: str,
    step: int,
    rank: int,
    world_size: int,
    *,
    replicas: int = defaults.DEFAULT_REPLICAS,
    wait: bool = True,
    metadata: Mapping[str, str] | None = None,
    keep_last: int | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
) -> SavedVersion | SaveHandle:
    """Save this rank's part of `step`; the step commits when every rank's part is stored.
    Returns what save() returns for the part (a SaveHandle with wait=False)."""
    _check(step, rank, world_size)
    if keep_last is not None and keep_last < 1:
        raise ShardedCheckpointError(f"keep_last must be at least 1, not {keep_last}")
    steps = _steps()
    _raise_conflict(name, step, world_size, steps.begin(name, step, world_size))
    # The part describes itself on the nodes too: rebuild restores the step from these.
    own = {
        STEP_NAME_KEY: name,
        STEP_KEY: str(step),
        RANK_KEY: str(rank),
        WORLD_SIZE_KEY: str(world_size),
    }
    part = part_name(name, step, rank, world_size)
    spec = {"name": name, "step": step, "rank": rank, "world_size": world_size}
    if keep_last is not None:
        spec["keep_last"] = keep_last
    handle = start_save(state_dict, part, replicas, {**(metadata or {}), **own}, staging_dir, spec)
    return handle.result() if wait else handle


def record_part(spec: dict[str, Any], part: str, saved: SavedVersion) -> None:
    """Record a committed part in its step (the writer process runs this before the save's
    handle reports it); the last part commits the step, then keep_last prunes."""
    name, step, world_size = spec["name"], spec["step"], spec["world_size"]
    vkey = storage_key(part, saved.version_id)
    done = _steps().complete(
        name, step, world_size, Part(spec["rank"], part, vkey, saved.version_id, saved.size)
    )
    _raise_conflict(name, step, world_size, done)
    if done == [COMMITTED] and spec.get("keep_last") is not None:
        prune(name, spec["keep_last"])


def _raise_conflict(name: str, step: int, world_size: int, answer: Sequence[str]) -> None:
    if answer[0] == "world_size":
        raise WorldSizeMismatchError(
            f"step {step} of {name} was started with world size {answer[1]}, not {world_size}: "
            "every rank of a step must agree on it. Save this run's steps under another name."
        )
    if answer[0] == "state" and answer[1] != PENDING:
        raise ShardedCheckpointError(
            f"step {step} of {name} is already {answer[1]}; a step is saved once. Save the "
            "next step instead."
        )


def latest_step(name: str) -> int | None:
    """The newest step of `name` every rank finished storing; None if there is none."""
    return _steps().latest(name)


def load_sharded(
    name: str,
    step: int,
    rank: int,
    world_size: int,
    *,
    framework: str = "torch",
    tensors: Sequence[str] | None = None,
    device: str | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
    source: str = "auto",
) -> Any:
    """This rank's state (as it was saved) of a committed step, refusing loudly a
    world-size change, a partial step or a missing rank. `source` as for load()."""
    _check(step, rank, world_size)
    md = connected_metadata()
    found = Steps(md.r).get(name, step)
    latest = Steps(md.r).latest(name)
    hint = (
        f" The newest complete step is {latest}."
        if latest is not None
        else " No step of it is complete."
    )
    if found is None or found.state == REMOVING:
        raise StepNotFoundError(
            f"no step {step} of {name}"
            + (" (removed by keep-last-K)" if found is not None else "")
            + "."
            + hint
        )
    if found.world_size != world_size:
        raise WorldSizeMismatchError(
            f"step {step} of {name} was saved by {found.world_size} ranks, not {world_size}: "
            "resuming it on another world size would hand ranks the wrong state. Resume "
            f"with world_size={found.world_size}, or reshard it yourself."
        )
    if found.state != COMMITTED:
        missing = sorted(set(range(world_size)) - set(found.parts))
        raise PartialStepError(
            f"step {step} of {name} is partial: ranks {_ranks(missing)} never finished "
            f"storing their part, so it was never committed.{hint}"
        )
    gone = [
        r
        for r in range(world_size)
        if r not in found.parts or md.versions.state(found.parts[r].vkey) != VERSION_COMMITTED
    ]
    if gone:
        raise MissingRankError(
            f"step {step} of {name} is missing the part of ranks {_ranks(gone)} (removed or "
            f"not committed); resuming the other ranks alone would desynchronise them.{hint}"
        )
    part = found.parts[rank]
    return load(
        part.name,
        version=part.version_id,
        framework=framework,
        tensors=tensors,
        device=device,
        staging_dir=staging_dir,
        source=source,
    )


def _ranks(ranks: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def prune(name: str, keep_last: int) -> list[int]:
    """Remove the committed steps of `name` older than its `keep_last` newest committed
    ones; returns their numbers. Pending steps (saves in flight) are left alone. Steps an
    earlier prune marked are forgotten once their parts' versions are gone."""
    md = connected_metadata()
    steps = Steps(md.r)
    recorded = steps.all(name)
    committed = [s for s in recorded if s.state == COMMITTED]
    removed = []
    for old in committed[: max(0, len(committed) - keep_last)]:
        if steps.mark_removing(name, old.step):
            removed.append(old.step)
    for s in steps.all(name):
        if s.state != REMOVING:
            continue
        states = {md.versions.state(p.vkey) for p in s.parts.values()}
        if states <= {None, REMOVED}:
            steps.forget(name, s.step)
            continue
        for p in s.parts.values():
            if md.versions.state(p.vkey) == VERSION_COMMITTED:
                submit_remove(p.vkey)
    return removed
