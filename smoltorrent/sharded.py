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
save_sharded(wait=True) returns once the whole step is committed (every rank's part),
not only this rank's part: a load right after it, on any rank, finds the step.
load_sharded refuses, each with its own error under ShardedCheckpointError: a world
size other than the step's (WorldSizeMismatchError), a step not every rank finished
(PartialStepError, saying of each missing rank whether its part is still in flight,
abandoned, failed, or not begun), a committed step one of whose parts is gone
(MissingRankError).
A saved part's version id (a SHA-256 over its header and blob digests) is the rank's
digest; loading it verifies every byte against the blob digests.

Resharding: a rank that records partitions= says which of its tensors are its share of
a larger one, ("flat", offset, total) for a flat ZeRO partition (elements offset..
offset+numel of a 1-D tensor of `total`) or ("rows", first_row, total_rows) for a dim-0
row shard. load_sharded(..., reshard=True) on another world size loads every rank's part,
puts each partitioned tensor back together (its pieces must tile it exactly) and hands
this rank its share by partition(): ceil(total / world_size) each, the last ranks'
shorter, as DeepSpeed's ZeRO and torch.chunk cut. Everything else comes from rank 0's
part (replicated state: the step, the scheduler, unsharded tensors).

keep_last=K (on any rank; the rank that commits a step applies it) removes the
committed steps older than the K newest once the new step is committed, never before;
steps still pending (a save in flight) are never touched.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from coordinator import config
from coordinator.plan.version_ids import storage_key
from coordinator.state.steps import (
    COMMITTED,
    PENDING,
    RANK_KEY,
    REMOVING,
    STEP_KEY,
    STEP_NAME_KEY,
    WORLD_SIZE_KEY,
    Part,
    Step,
    Steps,
)
from coordinator.state.versions import COMMITTED as VERSION_COMMITTED
from coordinator.state.versions import REMOVED
from smoltorrent import defaults
from smoltorrent.api import SavedVersion, SaveHandle, load, manifest_metadata, start_save
from smoltorrent.errors import (
    MetadataError,
    MissingRankError,
    PartialStepError,
    ShardedCheckpointError,
    StepNotFoundError,
    WorldSizeMismatchError,
)
from smoltorrent.keypaths import STATE_KEY, flatten, parse_structure, unflatten
from tasks.requests import connected_metadata, submit_remove

PARTITIONS_KEY = "smoltorrent.partitions"  # header metadata: a part's shares, as JSON
_KINDS = ("flat", "rows")


def partition(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, count) of `rank`'s share of `total` elements (flat) or rows: ceil(total /
    world_size) each, the last ranks' shorter, as DeepSpeed's ZeRO and torch.chunk cut."""
    each = -(-total // world_size)
    start = min(total, rank * each)
    return start, min(total, start + each) - start


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
    partitions: Mapping[str, tuple[str, int, int]] | None = None,
) -> SavedVersion | SaveHandle:
    """Save this rank's part of `step`; the step commits when every rank's part is stored.
    With wait=True, return once the whole step is committed (this rank's part's
    SavedVersion); PartialStepError if another rank's part failed or was abandoned, or
    a rank never began its part within SMOLTORRENT_STEP_PATIENCE_S. With wait=False, a
    SaveHandle of this rank's part (its result() is the part's commit only).
    `partitions`: {key path: ("flat", offset, total) or ("rows", first_row, total_rows)}
    for the tensors that are this rank's share of a larger one, so that
    load_sharded(..., reshard=True) can re-partition them for another world size."""
    _check(step, rank, world_size)
    shares = _check_partitions(state_dict, partitions)
    if keep_last is not None and keep_last < 1:
        raise ShardedCheckpointError(f"keep_last must be at least 1, not {keep_last}")
    # Nothing here asks Redis (invariant 12): the writer opens the step (begin_part) and
    # records the part (record_part), retrying while Redis is away, as for any save.
    # The part describes itself on the nodes too: rebuild restores the step from these.
    own = {
        STEP_NAME_KEY: name,
        STEP_KEY: str(step),
        RANK_KEY: str(rank),
        WORLD_SIZE_KEY: str(world_size),
    }
    if shares:
        own[PARTITIONS_KEY] = json.dumps(shares)
    part = part_name(name, step, rank, world_size)
    spec = {"name": name, "step": step, "rank": rank, "world_size": world_size}
    if keep_last is not None:
        spec["keep_last"] = keep_last
    handle = start_save(state_dict, part, replicas, {**(metadata or {}), **own}, staging_dir, spec)
    if not wait:
        return handle
    saved = handle.result()
    _wait_for_step(name, step, rank, world_size, saved)
    return saved


def _wait_for_step(name: str, step: int, rank: int, world_size: int, saved: SavedVersion) -> None:
    """Return once the step is committed (every rank's part recorded). A rank whose part
    failed or was abandoned ends the wait at once; one that has not begun its part is
    waited for SMOLTORRENT_STEP_PATIENCE_S; one whose writer still beats, as long as it
    does (its writer gives up after SAVE_PATIENCE_S and records the failure)."""
    from redis.exceptions import RedisError

    patience = config.step_patience()
    deadline = time.monotonic() + patience
    trust_beats_after = 0.0  # no beat lands while Redis is away: none is judged stale then
    while True:
        try:
            steps = _steps()
            found = steps.get(name, step)
        except (RedisError, MetadataError):
            # Redis away: the other ranks' writers ride it out, and so does this wait.
            trust_beats_after = time.monotonic() + defaults.STEP_STALE_S
            deadline = max(deadline, trust_beats_after)
            time.sleep(defaults.SAVE_RETRY_S)
            continue
        if found is None or found.state != PENDING:
            # Committed (or committed and pruned by keep_last since): whole. Nothing else
            # takes a step out of pending.
            return
        now = time.time()
        kinds = _missing(found, now)
        if kinds["abandoned"] and time.monotonic() < trust_beats_after:
            kinds["in flight"] += kinds["abandoned"]  # their beats were missed with Redis
            kinds["abandoned"] = []
        give_up = kinds["failed"] or kinds["abandoned"]
        if not give_up and time.monotonic() > deadline and kinds["not begun"]:
            give_up = True
        if give_up:
            try:
                latest = steps.latest(name, world_size)
            except (RedisError, MetadataError):
                latest = None  # the hint only
            waited = "" if not kinds["not begun"] else f" (waited {patience:g} s for it)"
            raise PartialStepError(
                f"step {step} of {name} is not whole: rank {rank}'s part is stored (version "
                f"{saved.version_id[:12]}), but {_describe(found, kinds, now)}{waited}. "
                + _advice(name, step, found, kinds, latest)
            )
        time.sleep(defaults.STEP_WAIT_POLL_S)


def _check_partitions(
    state: Mapping[str, Any], partitions: Mapping[str, tuple[str, int, int]] | None
) -> dict[str, list]:
    """partitions= checked against the state before anything is saved."""
    if not partitions:
        return {}
    tensors = flatten(state).tensors
    shares = {}
    for path, spec in partitions.items():
        if (
            not isinstance(spec, Sequence)
            or len(spec) != 3
            or spec[0] not in _KINDS
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in spec[1:])
        ):
            raise ShardedCheckpointError(
                f"partitions[{path!r}] is {spec!r}; write ('flat', offset, total_numel) or "
                "('rows', first_row, total_rows)"
            )
        if path not in tensors:
            raise ShardedCheckpointError(
                f"partitions names {path!r}, which is no tensor's key path in this state (its "
                f"first: {', '.join(list(tensors)[:5])})"
            )
        kind, offset, total = spec
        tensor = tensors[path]
        if kind == "flat" and len(tensor.shape) != 1:
            raise ShardedCheckpointError(
                f"{path!r} is a flat partition but has shape {tuple(tensor.shape)}; flatten it"
            )
        count = _count(tensor)
        if offset + count > total:
            raise ShardedCheckpointError(
                f"{path!r}: offset {offset} + {count} is past its total {total}"
            )
        shares[path] = [kind, offset, total]
    return shares


def _count(tensor: Any) -> int:
    """Elements of a flat share, rows of a row share."""
    return int(tensor.shape[0])  # a flat share is 1-D: its elements


def begin_part(spec: dict[str, Any]) -> None:
    """Open the part's step, or join it, marking this rank's part begun (the writer runs
    this before submitting the part's store); WorldSizeMismatchError or
    ShardedCheckpointError for a conflict."""
    name, step, world_size = spec["name"], spec["step"], spec["world_size"]
    answer = _steps().begin(name, step, world_size, spec["rank"])
    _raise_conflict(name, step, world_size, answer)


def beat_part(spec: dict[str, Any]) -> None:
    """The writer still stores this rank's part (every STEP_BEAT_S while it does)."""
    _steps().beat(spec["name"], spec["step"], spec["rank"])


def fail_part(spec: dict[str, Any], error: str) -> None:
    """This rank's part failed for good: the other ranks stop waiting for it."""
    _steps().fail(spec["name"], spec["step"], spec["rank"], error)


_KINDS_MISSING = ("failed", "abandoned", "in flight", "not begun")


def _missing(found: Step, now: float) -> dict[str, list[int]]:
    """The ranks of a pending step whose part is not recorded, by what became of it:
    failed (its writer recorded a failure), abandoned (it began, and its writer has been
    silent past STEP_STALE_S: it died), in flight (began, its writer beats), not begun."""
    kinds: dict[str, list[int]] = {k: [] for k in _KINDS_MISSING}
    for r in range(found.world_size):
        if r in found.parts:
            continue
        if r in found.failed:
            kinds["failed"].append(r)
        elif r not in found.begun:
            kinds["not begun"].append(r)
        elif now - found.beats.get(r, found.begun[r]) > defaults.STEP_STALE_S:
            kinds["abandoned"].append(r)
        else:
            kinds["in flight"].append(r)
    return kinds


def _describe(found: Step, kinds: dict[str, list[int]], now: float) -> str:
    """What became of each missing rank's part, in words."""

    def ago(t: float) -> str:
        return f"{max(0, round(now - t))} s ago"

    said = []
    for kind in _KINDS_MISSING:
        ranks = kinds[kind]
        if not ranks:
            continue
        one, first = len(ranks) == 1, ranks[0]
        who = f"rank {first}" if one else f"ranks {_ranks(ranks)}"
        began = ago(found.begun[first]) if first in found.begun else None
        if kind == "in flight":
            said.append(
                f"rank {first}'s part is still being stored (began {began})"
                if one
                else f"{who} are still storing their parts (rank {first} began {began})"
            )
        elif kind == "failed":
            at, error = found.failed[first]
            said.append(
                f"rank {first} began {began} and failed {ago(at)}: abandoned ({error})"
                if one and began
                else f"{who} failed storing {'its part' if one else 'their parts'}: "
                f"abandoned (rank {first}, {ago(at)}: {error})"
            )
        elif kind == "abandoned":
            silent = ago(found.beats.get(first, found.begun[first]))
            said.append(
                f"{who} began {began if one else 'their parts'} and "
                f"{'its writer has' if one else 'their writers have'} not been heard from "
                f"since {silent if one else 'long ago'}: abandoned (the writer died, or its "
                "machine did)"
            )
        else:
            said.append(
                f"{who} never finished storing {'its part' if one else 'their parts'}: "
                f"{'it has' if one else 'they have'} not begun "
                f"{'it' if one else 'them'} (not saved yet, or died first)"
            )
    return "; ".join(said)


def _advice(
    name: str, step: int, found: Step, kinds: dict[str, list[int]], latest: int | None
) -> str:
    """What to do about a partial step."""
    gone = kinds["failed"] + kinds["abandoned"]
    missing = sorted(gone or kinds["not begun"] or kinds["in flight"])
    redo = (
        f"save_sharded(state, {name!r}, {step}, {missing[0]}, {found.world_size})"
        if len(missing) == 1
        else f"save_sharded(state, {name!r}, {step}, rank, {found.world_size}) on each of them"
    )
    older = (
        f"resume from the newest complete step, {latest}"
        if latest is not None
        else "no step of it is complete"
    )
    if gone:
        return (
            f"It will not commit by itself: {older}, or save the step again on "
            f"{'that rank' if len(missing) == 1 else 'those ranks'}: {redo} (the parts "
            "stored already count)."
        )
    if kinds["in flight"]:
        return (
            "It may still commit: load it once save_sharded(..., wait=True) has returned on "
            f"every rank (it returns when the whole step is stored), or {older}."
        )
    if latest is not None:
        return f"To load it, {older}, or commit this one: {redo}."
    return f"To load it, commit it ({older}): {redo}."


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


def latest_step(name: str, world_size: int | None = None, *, reshard: bool = False) -> int | None:
    """The newest step of `name` every rank finished storing that was saved by
    `world_size` ranks; None if there is none. Without world_size, this process group's
    size (torch.distributed, when initialized); with none either, the newest step, unless
    the name holds steps of several world sizes (WorldSizeMismatchError: say which).
    reshard=True: the newest step of any world size (for load_sharded(reshard=True))."""
    if world_size is not None and (
        not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
    ):
        raise ShardedCheckpointError(f"world_size must be an integer >= 1, not {world_size!r}")
    steps = _steps()
    if reshard:
        return steps.latest(name)
    world_size = world_size or _process_group_size()
    if world_size is not None:
        return steps.latest(name, world_size)
    sizes = sorted({s.world_size for s in steps.all(name) if s.state == COMMITTED})
    if len(sizes) > 1:
        raise WorldSizeMismatchError(
            f"{name} holds complete steps saved by world sizes {_ranks(sizes, sep=' and ')}, "
            "and nothing says which this run is: call latest_step(name, world_size=...) "
            "(or reshard=True for the newest of any, to load with reshard=True)"
        )
    return steps.latest(name)


def _process_group_size() -> int | None:
    """torch.distributed's world size when this process is in an initialized group; never
    imports torch for it."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_world_size()


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
    reshard: bool = False,
) -> Any:
    """This rank's state (as it was saved) of a committed step, refusing loudly a
    world-size change, a partial step or a missing rank. `source` as for load(). With
    reshard=True, a step saved by another world size is re-partitioned for this one (the
    tensors its ranks recorded in partitions=; the rest from rank 0's part)."""
    _check(step, rank, world_size)
    md = connected_metadata()
    found = Steps(md.r).get(name, step)
    latest = Steps(md.r).latest(name, None if reshard else world_size)
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
    if found.world_size != world_size and not reshard:
        raise WorldSizeMismatchError(
            f"step {step} of {name} was saved by {found.world_size} ranks, not {world_size}: "
            "resuming it on another world size would hand ranks the wrong state. Resume "
            f"with world_size={found.world_size}, or pass reshard=True to re-partition the "
            "tensors its ranks recorded in save_sharded(partitions=...)."
        )
    if found.state != COMMITTED:
        # The stored step's ranks, not the loading world's: under reshard=True they differ.
        now = time.time()
        kinds = _missing(found, now)
        raise PartialStepError(
            f"step {step} of {name} is partial: of its {found.world_size} ranks, "
            f"{_describe(found, kinds, now)}, so it is not committed. "
            + _advice(name, step, found, kinds, latest)
        )
    gone = [
        r
        for r in range(found.world_size)
        if r not in found.parts or md.versions.state(found.parts[r].vkey) != VERSION_COMMITTED
    ]
    if gone:
        # The newest complete step may be this one: point at an older step with every part.
        older = _whole_step_before(md, name, step)
        raise MissingRankError(
            f"step {step} of {name} is missing the part of "
            f"{'rank' if len(gone) == 1 else 'ranks'} {_ranks(gone)} of its {found.world_size} "
            "ranks (removed or not committed); resuming the other ranks alone would "
            "desynchronise them. "
            + (
                f"Resume from step {older}, the newest older step with every part."
                if older is not None
                else "No older step of it has every part."
            )
        )
    options = {"framework": framework, "device": device, "staging_dir": staging_dir}
    if found.world_size == world_size:
        part = found.parts[rank]
        return load(part.name, version=part.version_id, tensors=tensors, source=source, **options)
    if tensors is not None:
        raise ShardedCheckpointError("reshard=True loads whole parts; leave tensors= out")
    return _resharded(md, name, step, found, rank, world_size, source, options)


def _whole_step_before(md, name: str, step: int) -> int | None:
    """The newest committed step of `name` before `step` whose every part is committed."""
    for older in reversed(Steps(md.r).all(name)):
        if older.step >= step or older.state != COMMITTED:
            continue
        if all(
            r in older.parts and md.versions.state(older.parts[r].vkey) == VERSION_COMMITTED
            for r in range(older.world_size)
        ):
            return older.step
    return None


def _resharded(md, name, step, found, rank, world_size, source, options) -> Any:
    """This rank's share, on `world_size` ranks, of a step saved by found.world_size."""
    parts = [found.parts[r] for r in range(found.world_size)]
    shares = [_shares(md, p) for p in parts]
    if not shares[0]:
        raise WorldSizeMismatchError(
            f"step {step} of {name} was saved by {found.world_size} ranks with no "
            "partitions=, so nothing says how its tensors split: it cannot be resharded. "
            f"Resume with world_size={found.world_size}."
        )
    if any(s.keys() != shares[0].keys() for s in shares):
        raise ShardedCheckpointError(
            f"the ranks of step {step} of {name} recorded different partitions; it cannot "
            "be resharded"
        )
    flats = [flatten(load(p.name, version=p.version_id, source=source, **options)) for p in parts]
    tensors = dict(flats[0].tensors)
    for path, (kind, _, total) in shares[0].items():
        pieces = sorted(((s[path][1], r) for r, s in enumerate(shares)), key=lambda piece: piece[0])
        at = 0
        for offset, r in pieces:
            if offset != at or shares[r][path][2] != total:
                raise ShardedCheckpointError(
                    f"the shares of {path!r} in step {step} of {name} do not tile its "
                    f"{total} {'rows' if kind == 'rows' else 'elements'} (rank {r} starts at "
                    f"{offset}, expected {at}); it cannot be resharded"
                )
            at += _count(flats[r].tensors[path])
        if at != total:
            raise ShardedCheckpointError(
                f"the shares of {path!r} in step {step} of {name} cover {at} of {total}"
            )
        whole = _concat(flats[0].framework, [flats[r].tensors[path] for _, r in pieces])
        start, count = partition(total, rank, world_size)
        tensors[path] = _copy(whole[start : start + count])
    tree = parse_structure({STATE_KEY: flats[0].structure} if flats[0].structure else None)
    return tensors if tree is None else unflatten(tree, tensors)


def _shares(md, part: Part) -> dict[str, list]:
    """The partitions a part recorded, read from its manifest's header (no gather)."""
    metadata = manifest_metadata(md.versions.manifest(part.vkey))
    return json.loads(metadata.get(PARTITIONS_KEY, "{}"))


def _concat(framework: str, pieces: list[Any]) -> Any:
    if framework == "torch":
        import torch

        return torch.cat(pieces)
    if framework == "numpy":
        import numpy as np

        return np.concatenate(pieces)
    import mlx.core as mx

    return mx.concatenate(pieces)


def _copy(view: Any) -> Any:
    """Its own memory, not a view keeping the whole tensor alive."""
    return (
        view.clone() if hasattr(view, "clone") else view.copy() if hasattr(view, "copy") else view
    )


def _ranks(ranks: Sequence[int], limit: int = 8, sep: str = ", ") -> str:
    shown = sep.join(map(str, ranks[:limit]))
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
