"""The ranks of the kill-and-resume test (tests/smoltorrent/test_dcp_resume.py), under
torchrun with gloo on CPU, and of its resharding.

`python -m tests.smoltorrent.dcp_resume_run train OUT RUN KILL_STEP`, under torchrun with
--max-restarts=1, as a job that restarts after a crash runs:
- attempt 0 trains a run that is never interrupted (no save), then the same run from
  scratch again, saving every SAVE_EVERY steps through smoltorrent.dcp.Writer; at
  KILL_STEP's save, rank 0 stops itself (SIGSTOP) with its part in flight (submitted to
  the cluster, not yet recorded in the step: rank 1's part already is) and says so in
  OUT/held, for the test to SIGKILL it;
- attempt 1 (torchrun restarts the job) resumes from smoltorrent.dcp.latest(RUN) and
  trains to STEPS, saving as before; its final state is also saved by FileSystemWriter
  into OUT/fs, for the resharding to compare with.
Each rank writes its per-step losses as it goes, and its final local shards.

`python -m tests.smoltorrent.dcp_resume_run reshard OUT NAME`, under torchrun with any
number of ranks: NAME loaded through smoltorrent.dcp.Reader and OUT/fs through DCP's
FileSystemReader into fresh models sharded over these ranks, the sharded load gathered
whole; then, the process group destroyed, rank 0 does the same in one process (a plain
model) and compares it with the gathered load.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from tests.smoltorrent.dcp_run import bits, model, sharded_model

STEPS = 6
SAVE_EVERY = 2
LR = 1e-2  # large enough that every step moves every weight


def batch(step: int, rank: int) -> torch.Tensor:
    """The step's inputs on this rank: a function of (step, rank) only, as a loader
    resumed at its position gives (nothing else draws from it)."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model fully_shard'ed over every rank (FSDP2), and its AdamW."""
    net = sharded_model(seed)
    return net, torch.optim.AdamW(net.parameters(), lr=LR)


def state(net: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(net, optim)
    return {"model": msd, "optim": osd, "extra": {"step": step}}


def load(net: torch.nn.Module, optim: torch.optim.Optimizer, reader: Any) -> int:
    """Load through `reader` into net and optim; the step it was saved at."""
    into = state(net, optim, 0)
    dcp.load(into, storage_reader=reader)
    set_state_dict(net, optim, model_state_dict=into["model"], optim_state_dict=into["optim"])
    return into["extra"]["step"]


def local(net: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the parameters and the optimizer state, as bits."""

    def own(tree: Any) -> Any:
        if isinstance(tree, dict):
            return {k: own(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [own(v) for v in tree]
        return tree.to_local() if hasattr(tree, "to_local") else tree

    msd, osd = get_state_dict(net, optim)
    return bits(own({"model": msd, "optim": osd}))


def train(net, optim, start: int, losses: Path, save=None) -> None:
    """Steps start+1 .. STEPS; each step's loss appended to `losses` as it is known
    (exactly: float.hex of the float32), `save(step)` every SAVE_EVERY steps."""
    rank = dist.get_rank()
    for step in range(start + 1, STEPS + 1):
        loss = net(batch(step, rank)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        with losses.open("a") as f:
            f.write(json.dumps([step, loss.item().hex()]) + "\n")
        if save is not None and step % SAVE_EVERY == 0:
            save(step)


def write_json(path: Path, value: Any) -> None:
    """Whole or not at all (the test polls for it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(path)


def hold_rank_0_part(out: Path, run: str, step: int) -> None:
    """At `step`'s save, rank 0 stops itself once its part is submitted to the cluster
    and before it waits for it and records it in the step: the save is in flight."""
    import tasks.requests
    from smoltorrent.sharded import part_name

    part = part_name(run, step, 0, dist.get_world_size())
    real = tasks.requests.wait_store

    def wait_store(request: Any, *args: Any, **kwargs: Any) -> dict:
        if request.name == part:
            write_json(out / "held", {"pid": os.getpid(), "part": part, "path": request.path})
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(request, *args, **kwargs)

    tasks.requests.wait_store = wait_store


def run_train(out: Path, run: str, kill_step: int) -> None:
    import smoltorrent.dcp
    from coordinator.state.steps import Steps
    from smoltorrent.dcp.steps import split
    from tasks.requests import connected_metadata

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def save(net, optim):
        def at(step: int) -> None:
            writer = smoltorrent.dcp.Writer(f"{run}/step_{step}")
            dcp.save(state(net, optim, step), storage_writer=writer)

        return at

    if attempt == 0:
        net, optim = sharded(0)
        train(net, optim, 0, out / f"losses-reference-{rank}")
        write_json(out / f"reference-{rank}.json", local(net, optim))
        net, optim = sharded(0)
        if rank == 0:
            hold_rank_0_part(out, run, kill_step)
        train(net, optim, 0, out / f"losses-killed-{rank}", save(net, optim))
        raise SystemExit(f"rank {rank}: attempt 0 was to be killed at step {kill_step}'s save")

    newest = smoltorrent.dcp.latest(run)
    if rank == 0:
        # What the crash left, as the resumed job finds it.
        killed = Steps(connected_metadata().r).get(*split(f"{run}/step_{kill_step}"))
        write_json(
            out / "found",
            {
                "latest": newest,
                "killed_step": None
                if killed is None
                else {"state": killed.state, "parts": sorted(killed.parts)},
            },
        )
    net, optim = sharded(1)  # other weights: a load that did nothing shows
    start = load(net, optim, smoltorrent.dcp.Reader(newest))
    train(net, optim, start, out / f"losses-resumed-{rank}", save(net, optim))
    write_json(out / f"resumed-{rank}.json", local(net, optim))
    dcp.save(state(net, optim, STEPS), storage_writer=dcp.FileSystemWriter(out / "fs"))
    dist.destroy_process_group()


def plain(reader: Any) -> dict[str, Any]:
    """A plain model and AdamW (one process, no process group) loaded through `reader`."""
    net = model(2)
    optim = torch.optim.AdamW(net.parameters(), lr=LR)
    load(net, optim, reader)
    msd, osd = get_state_dict(net, optim)
    return bits({"model": msd, "optim": osd})


def differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def run_reshard(out: Path, name: str) -> None:
    import smoltorrent.dcp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    found: dict[str, Any] = {}
    net, optim = sharded(1)
    found["step"] = load(net, optim, smoltorrent.dcp.Reader(name))
    ours = local(net, optim)
    other, other_optim = sharded(2)
    load(other, other_optim, dcp.FileSystemReader(out / "fs"))
    found["differ"] = differ(ours, local(other, other_optim))
    found["tensors"] = sum(1 for v in ours.values() if isinstance(v, list))
    # The sharded load, gathered whole, to compare with the plain load below.
    msd, osd = get_state_dict(
        net, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    gathered = bits({"model": msd, "optim": osd})
    dist.destroy_process_group()
    if rank == 0:
        # With the process group gone, DCP loads as one process. (Done before
        # init_process_group, these loads kept the other ranks waiting in the rendezvous
        # for rank 0's TCPStore.)
        whole = plain(smoltorrent.dcp.Reader(name))
        found["plain_differ"] = differ(whole, plain(dcp.FileSystemReader(out / "fs")))
        found["plain_tensors"] = sum(1 for v in whole.values() if isinstance(v, list))
        found["whole_differ"] = differ(whole, gathered)
    write_json(out / f"reshard-{world}-{rank}.json", found)


if __name__ == "__main__":
    mode, where, *rest = sys.argv[1:]
    if mode == "train":
        run_train(Path(where), rest[0], int(rest[1]))
    else:
        run_reshard(Path(where), rest[0])
    # Done, every output written: leave without Python's finalization. A ProcessGroupGloo
    # worker thread destroys a finished collective's work (its tensors are Python objects)
    # after wait() has returned; on a loaded box it can come to that only once the main
    # thread is finalizing, when taking the GIL ends the thread (pthread_exit) and the
    # unwind through the work's noexcept destructor calls std::terminate: the rank, its
    # work done, died of SIGABRT ("terminate called without an active exception"; a
    # core showed Py_FinalizeEx's gc on the main thread, ProcessGroupGloo::runLoop in
    # ~AsyncBroadcastWork on the aborting one) and torchrun failed the job.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
