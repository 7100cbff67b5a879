"""A DCP checkpoint is a step of per-rank parts (smoltorrent/sharded.py's machinery):
`Writer("run/step_100")` saves step 100 of run "run", each rank's items one part,
`run/step-00000100/rank-RRRRR-of-WWWWW.safetensors`, recorded in the step's Redis hash
(coordinator/state/steps.py) once committed. Rank 0 stores its part last, from DCP's
finish(), with the checkpoint's Metadata as JSON in its header: the part that completes
the step carries the metadata, so a step every rank finished has it, and a step some
rank never finished is never committed, never read, never the newest.

A part is written as a .safetensors file in memory (smoltorrent/dcp/scratch.py: /dev/shm,
the staging directory where there is none), stored through the same request a CLI store
makes, and deleted once committed (or, if its writer was killed, by the next part's
writer): nothing is kept on the training machine's disk or in its memory.
"""

from __future__ import annotations

import os
import re

import torch

from coordinator.state.steps import (
    COMMITTED,
    RANK_KEY,
    STEP_KEY,
    STEP_NAME_KEY,
    WORLD_SIZE_KEY,
    Steps,
)
from smoltorrent.api import SavedVersion, manifest_metadata
from smoltorrent.dcp import scratch
from smoltorrent.errors import ShardedCheckpointError
from smoltorrent.sharded import part_name, record_part

DCP_NAME_KEY = "smoltorrent.dcp.name"  # header metadata of rank 0's part: the name saved
DCP_METADATA_KEY = "smoltorrent.dcp.metadata"  # header metadata of rank 0's part: its JSON
_STEP = re.compile(r"(\d+)$")  # the step: the digits ending the name's last component


def split(name: str) -> tuple[str, int]:
    """("run", 100) of "run/step_100": the run is the name's parent, the step the digits
    its last component ends with."""
    if not isinstance(name, (str, os.PathLike)):
        raise ShardedCheckpointError(f"a DCP checkpoint name is a string, not {name!r}")
    name = os.fspath(name).strip("/")
    run, _, last = name.rpartition("/")
    found = _STEP.search(last)
    if not run or found is None:
        raise ShardedCheckpointError(
            f"{name!r} names no step: name a DCP checkpoint RUN/STEP, its last part ending in "
            "the step number (e.g. 'run1/step_100'), so that smoltorrent.dcp.latest('run1') "
            "can find the newest complete one"
        )
    return run, int(found.group(1))


def steps() -> Steps:
    from tasks.requests import connected_metadata

    return Steps(connected_metadata().r)


def begin(name: str, world_size: int) -> None:
    """Open the step (or join it), refusing a step already saved or started by another
    world size."""
    run, step = split(name)
    answer = steps().begin(run, step, world_size)
    if answer[0] == "world_size":
        raise ShardedCheckpointError(
            f"{name} was started by {answer[1]} ranks, not {world_size}: every rank of a "
            "save must agree. Save under another step."
        )
    if answer[0] == "state" and answer[1] != "pending":
        raise ShardedCheckpointError(
            f"{name} is already {answer[1]}; a DCP checkpoint is saved once. Save the next "
            "step under a new name."
        )


def store_part(
    name: str,
    rank: int,
    world_size: int,
    tensors: dict[str, torch.Tensor],
    header: dict[str, str],
    replicas: int,
) -> str:
    """Store one rank's items as its part of the step and record it; the step's state
    after (committed once every rank's part is recorded)."""
    from safetensors import TensorSpec, serialize_file

    from tasks.requests import connected_metadata, submit_store, wait_store

    run, step = split(name)
    part = part_name(run, step, rank, world_size)
    own = {
        STEP_NAME_KEY: run,
        STEP_KEY: str(step),
        RANK_KEY: str(rank),
        WORLD_SIZE_KEY: str(world_size),
    }
    specs = {
        key: TensorSpec(
            dtype=str(t.dtype).removeprefix("torch."),
            shape=list(t.shape),
            data_ptr=t.data_ptr() if t.numel() else 0,
            data_len=t.numel() * t.element_size(),
        )
        for key, t in tensors.items()
    }
    with scratch.part_file() as path:
        serialize_file(specs, str(path), metadata={**header, **own})
        # On a host no worker serves, this process stores it (wait_store runs it).
        request = submit_store(str(path), part, replicas, complete=True, in_process=True)
        out = wait_store(request)
        v = connected_metadata().versions.version(out["vkey"])
    saved = SavedVersion(part, v["version_id"], bool(out["new"]), int(v["size"]))
    spec = {"name": run, "step": step, "rank": rank, "world_size": world_size}
    record_part(spec, part, saved)
    found = steps().get(run, step)
    return found.state if found is not None else "missing"


def committed_metadata(name: str) -> tuple[dict[str, str], dict[int, tuple[str, str]]]:
    """The header metadata of rank 0's part of a committed step and every rank's part
    (rank -> (part name, version id)); StepNotFoundError or PartialStepError otherwise."""
    from smoltorrent.errors import PartialStepError, StepNotFoundError
    from tasks.requests import connected_metadata

    run, step = split(name)
    md = connected_metadata()
    found = Steps(md.r).get(run, step)
    newest = latest(run)
    hint = f" The newest complete one is {newest}." if newest else " No step of it is complete."
    if found is None or found.state not in (COMMITTED, "pending"):
        raise StepNotFoundError(f"no DCP checkpoint {name}.{hint}")
    if found.state != COMMITTED:
        missing = sorted(set(range(found.world_size)) - set(found.parts))
        raise PartialStepError(
            f"{name} is partial: of its {found.world_size} ranks, {missing} never finished "
            f"storing, so it was never committed (a save still in flight, or one that died).{hint}"
        )
    parts = {r: (p.name, p.version_id) for r, p in found.parts.items()}
    header = manifest_metadata(md.versions.manifest(found.parts[0].vkey))
    if DCP_METADATA_KEY not in header:
        raise StepNotFoundError(
            f"{name} is a step saved by save_sharded, not by DCP: load it with "
            "smoltorrent.load_sharded"
        )
    return header, parts


def latest(run: str) -> str | None:
    """The name of the newest DCP checkpoint of `run` every rank finished storing (as it
    was given to Writer, e.g. "run/step_100"), or None."""
    from tasks.requests import connected_metadata

    md = connected_metadata()
    for found in reversed(Steps(md.r).all(run.strip("/"))):
        if found.state != COMMITTED or 0 not in found.parts:
            continue
        header = manifest_metadata(md.versions.manifest(found.parts[0].vkey))
        if DCP_NAME_KEY in header:
            return header[DCP_NAME_KEY]
    return None
