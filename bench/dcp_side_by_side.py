"""An FSDP2 training state saved three ways in one run (issue 39 item 5): DCP's
async_save in process mode to local disk (twice: with FileSystemWriter's own stager and
with the one async_save gives smoltorrent's Writer), the same call into smoltorrent, and
smoltorrent's own save_sharded(wait=False); for each, how long the training loop is
blocked, how long until the step is durable, and how long it takes to load back.

    .venv/bin/python -m bench.dcp_side_by_side [--size-mb 1024] [--repeat 3] [--nodes 4]
                                               [--json OUT] [--scratch DIR]

A local cluster (redis-server, --nodes node processes, a Celery worker; R=2) is started
once, then 2 ranks under torchrun (gloo on CPU, one torch thread each: the box has 2
cores) build the tests' FSDP2 model (tests/smoltorrent/dcp_run.py's sharded_model, here
with DEPTH hidden layers wide enough for --size-mb of parameters and AdamW's two moments,
fp32) and take one AdamW step. Each rank's state is get_state_dict's, as DCP saves it.
Before the measured saves, a tiny save of each kind starts what a first save starts (DCP's
checkpoint process and its process group; smoltorrent's writer process): their times are
in the JSON as "warm_up", not in the table.

Per repeat, for each way in turn (every parameter and moment changed first, untimed, as a
training step would: so no save finds its bytes already stored; the ranks start each call
together, after a barrier; the slowest rank's time is the figure):

  dcp_disk  dcp.async_save(state, storage_writer=FileSystemWriter(DIR),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS). durable: its future
            done (FileSystemWriter fsyncs each file and the metadata itself) and DIR
            fsync'd after, by each rank.
  dcp_disk_default  the same with async_stager=DefaultStager(...), the stager async_save
            gives a writer that is not one (smoltorrent's Writer): FileSystemWriter stages
            through its own BlockingAsyncStager, which for a CPU DTensor deep-copies it and
            then copies it again into a new tensor (torch 2.13's _create_cpu_state_dict),
            so this row tells the stager's share of the stall from the storage's.
  dcp_st    the same call with storage_writer=smoltorrent.dcp.Writer(name). durable: its
            future done, which is the step committed: rank 0 stores its part last, from
            DCP's finish(), and finish raises unless that commits the step; committed is
            every chunk on R nodes, each copy fsync'd there (checked after the run: no
            committed shard short of R in `smoltorrent status`, and no repair runs here).
  sharded   smoltorrent.save_sharded(the state with each DTensor's local shard, name,
            step, rank, 2, wait=False). durable: the step committed (every rank's part),
            polled with smoltorrent.latest_step every POLL_S once the rank's
            handle.result() (its own part committed) returned.

stall is the call (for save_sharded, with the .to_local() of each DTensor). Between the
call and durable the ranks do nothing else, so durable is a save's time on an otherwise
idle box; the CPU a background save takes from a training step is bench/save_cpu.py's.

Each save is then loaded back into the same sharded model and optimizer (every tensor
zeroed first; checked bit for bit against what was saved, untimed), timed from the call to
set_state_dict's return: dcp.load with FileSystemReader(DIR) or smoltorrent.dcp.Reader
(name), then set_state_dict; for save_sharded, load_sharded(..., source="cluster")
(gathered from the nodes) and source="local" (the copy the writer keeps on this machine,
every byte checked against the manifest), copied into each DTensor's local shard, then
set_state_dict. Every file read was just written, so every load reads the page cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/dcp_side_by_side.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.local_cluster import registered_cluster  # noqa: E402
from bench.report import head_commit, machine, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
RANKS = 2  # one per core of the 2-core box the figures came from
# Hidden layers of the model: 10 Linear layers, each its own FSDP2 unit, 60 tensors in
# the state, each ~40 MiB at the default size (an LLM's are 10-100 MiB).
DEPTH = 8
STATE_BYTES_PER_PARAMETER = 12  # fp32 parameter, AdamW's exp_avg and exp_avg_sq
POLL_S = 0.02  # between looks at latest_step: well under the commits' seconds
RUN_NAME = "bench-dcp"  # smoltorrent.dcp.Writer's steps: bench-dcp/step_N
SHARDED_NAME = "bench-sharded"  # save_sharded's steps
LABELS = {
    "dcp_disk": "DCP `async_save` (process) -> `FileSystemWriter`, local disk",
    "dcp_disk_default": "the same, `async_stager=DefaultStager(...)`",
    "dcp_st": "DCP `async_save` (process) -> `smoltorrent.dcp.Writer`",
    "sharded": "`smoltorrent.save_sharded(wait=False)`",
    "sharded_cluster": "`load_sharded(source='cluster')`",
    "sharded_local": "`load_sharded(source='local')` (local tier)",
}


def width_for(size_mb: float) -> int:
    """The hidden width (a multiple of 64) whose DEPTH layers of width x width hold about
    `size_mb` MiB of parameters and AdamW moments."""
    per_layer = size_mb * MIB / STATE_BYTES_PER_PARAMETER / DEPTH
    return max(64, round(math.sqrt(per_layer) / 64) * 64)


# --- one rank, under torchrun ------------------------------------------------------


def _tensors(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{key path: tensor} of a state, a DTensor as its local shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        if isinstance(tree, DTensor):
            return {prefix: tree.to_local()}
        return {prefix: tree} if hasattr(tree, "data_ptr") else {}
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{prefix}{key}/").items()}


def _local(tree: Any) -> Any:
    """The state with each DTensor replaced by its local shard (a view: nothing copied),
    what save_sharded takes."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(v) for v in tree)
    return tree.to_local() if isinstance(tree, DTensor) else tree


class Rank:
    def __init__(self, size_mb: float, directory: Path) -> None:
        import torch.distributed as dist

        from tests.smoltorrent.dcp_run import sharded_model, trained

        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.directory = directory
        self.net = sharded_model(0, width_for(size_mb), DEPTH)
        self.optim = trained(self.net, 0)
        self.saved: dict[str, Any] = {}  # a clone of every tensor of the last save

    def slowest(self, seconds: float) -> float:
        import torch.distributed as dist

        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, seconds)
        return max(every)

    def state(self) -> dict[str, Any]:
        from tests.smoltorrent.dcp_run import state

        return state(self.net, self.optim)

    def change(self, step: int) -> dict[str, Any]:
        """A training step's update, untimed: every tensor of the state changed (so no
        save finds its chunks already stored), the state as it is to be saved, and a
        clone of each of its tensors to check the loads against."""
        import torch

        with torch.no_grad():
            for t in _tensors(self.state()).values():
                if t.is_floating_point():
                    t.add_(0.001)
        state = self.state()
        state["extra"]["step"] = step
        self.saved = {k: t.clone() for k, t in _tensors(state).items()}
        return state

    def state_bytes(self) -> int:
        local = sum(t.numel() * t.element_size() for t in _tensors(self.state()).values())
        return int(sum(self.all(local)))

    def all(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, value)
        return every

    def dcp_save(
        self, state: dict[str, Any], writer: Any, directory: Path | None, stager: Any = None
    ) -> dict:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save(
            state,
            storage_writer=writer,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
        stall = time.perf_counter() - start
        future.result()
        if stager is not None:
            stager.close()  # one the caller gives is the caller's to close
        if directory is not None:
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        durable = time.perf_counter() - start
        return {"stall": self.slowest(stall), "durable": self.slowest(durable)}

    def sharded_save(self, state: dict[str, Any], name: str, step: int) -> dict:
        import torch.distributed as dist

        import smoltorrent

        dist.barrier()
        start = time.perf_counter()
        handle = smoltorrent.save_sharded(
            _local(state), name, step, self.rank, self.world, wait=False
        )
        stall = time.perf_counter() - start
        handle.result()
        part = time.perf_counter() - start
        while smoltorrent.latest_step(name, self.world) != step:
            time.sleep(POLL_S)
        durable = time.perf_counter() - start
        return {
            "stall": self.slowest(stall),
            "part_committed": self.slowest(part),
            "durable": self.slowest(durable),
        }

    def timed_load(self, load: Any) -> float:
        """Every tensor zeroed, `load(into)` (which fills `into`, the model's state)
        timed with set_state_dict after it, and every tensor checked against the save."""
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import set_state_dict

        with torch.no_grad():
            for t in _tensors(self.state()).values():
                t.zero_()
        into = self.state()
        dist.barrier()
        start = time.perf_counter()
        load(into)
        set_state_dict(
            self.net, self.optim, model_state_dict=into["model"], optim_state_dict=into["optim"]
        )
        seconds = time.perf_counter() - start
        now = _tensors(self.state())
        wrong = sorted(k for k, t in self.saved.items() if not torch.equal(now.get(k), t))
        if any(self.all(wrong)):
            raise SystemExit(f"rank {self.rank}: a load gave back other values: {wrong[:5]}")
        return self.slowest(seconds)

    def warm_up(self) -> dict[str, float]:
        """A tiny save of each kind: DCP's first process-mode save starts its checkpoint
        process (and its process group), smoltorrent's first save its writer."""
        import torch
        import torch.distributed.checkpoint as dcp

        import smoltorrent.dcp

        tiny = {"w": torch.zeros(4)}
        out = {}
        start = time.perf_counter()
        self.dcp_save(tiny, dcp.FileSystemWriter(self.directory / "warm-up"), None)
        out["dcp_disk"] = self.slowest(time.perf_counter() - start)
        start = time.perf_counter()
        self.dcp_save(tiny, smoltorrent.dcp.Writer("bench-warm-up/step_0"), None)
        out["dcp_st"] = self.slowest(time.perf_counter() - start)
        start = time.perf_counter()
        self.sharded_save(tiny, "bench-warm-up-sharded", 0)
        out["sharded"] = self.slowest(time.perf_counter() - start)
        return out

    def repeat(self, i: int) -> dict[str, dict]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        import smoltorrent
        import smoltorrent.dcp

        step = i + 1
        directory = self.directory / f"step_{step}"
        name = f"{RUN_NAME}/step_{step}"
        saves, loads = {}, {}

        def load_sharded(source: str):
            def into_model(into: dict[str, Any]) -> None:
                stored = smoltorrent.load_sharded(
                    SHARDED_NAME, step, self.rank, self.world, source=source
                )
                got = _tensors(stored)
                for key, t in _tensors(into).items():
                    t.copy_(got[key])

            return into_model

        state = self.change(step)
        saves["dcp_disk"] = self.dcp_save(state, dcp.FileSystemWriter(directory), directory)
        loads["dcp_disk"] = self.timed_load(
            lambda into: dcp.load(into, storage_reader=dcp.FileSystemReader(directory))
        )
        state = self.change(step)
        other = self.directory / f"default-stager-step_{step}"
        # What async_save makes for a writer that is no stager: a copy, nothing pinned or
        # shared, staged in the call.
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        saves["dcp_disk_default"] = self.dcp_save(state, dcp.FileSystemWriter(other), other, stager)
        loads["dcp_disk_default"] = self.timed_load(
            lambda into: dcp.load(into, storage_reader=dcp.FileSystemReader(other))
        )
        state = self.change(step)
        saves["dcp_st"] = self.dcp_save(state, smoltorrent.dcp.Writer(name), None)
        if smoltorrent.dcp.latest(RUN_NAME) != name:
            raise SystemExit(f"{name}: its future is done, yet it is not the newest step")
        loads["dcp_st"] = self.timed_load(
            lambda into: dcp.load(into, storage_reader=smoltorrent.dcp.Reader(name))
        )
        state = self.change(step)
        saves["sharded"] = self.sharded_save(state, SHARDED_NAME, step)
        loads["sharded_cluster"] = self.timed_load(load_sharded("cluster"))
        loads["sharded_local"] = self.timed_load(load_sharded("local"))
        return {"saves": saves, "loads": loads}


def run_ranks(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    rank = Rank(args.size_mb, Path(args.dir))
    try:
        out: dict[str, Any] = {
            "state_bytes": rank.state_bytes(),
            "width": width_for(args.size_mb),
            "depth": DEPTH,
            "tensors_per_rank": len(_tensors(rank.state())),
            "warm_up": rank.warm_up(),
            "runs": [],
        }
        for i in range(args.repeat):
            out["runs"].append(rank.repeat(i))
            if rank.rank == 0:
                print(json.dumps(out["runs"][-1]), file=sys.stderr, flush=True)
        if rank.rank == 0:
            Path(args.ranks_out).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


# --- the run: a cluster, torchrun, the table ---------------------------------------


def summary(runs: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """{way: {figure: {median, min, max}}} over the runs."""

    def stats(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    out: dict[str, dict[str, dict[str, float]]] = {}
    for kind in ("saves", "loads"):
        for way in runs[0][kind]:
            figures = runs[0][kind][way]
            if kind == "loads":
                out.setdefault(way, {})["load"] = stats([r[kind][way] for r in runs])
                continue
            for figure in figures:
                out.setdefault(way, {})[figure] = stats([r[kind][way][figure] for r in runs])
    return out


def table(result: dict) -> str:
    s = result["summary"]

    def cell(way: str, figure: str) -> str:
        m = s[way][figure]
        if len(result["runs"]) == 1:
            return f"{m['median']:.2f}"
        return f"{m['median']:.2f} ({m['min']:.2f}-{m['max']:.2f})"

    rows = [
        f"| {LABELS[way]} | {cell(way, 'stall')} | {cell(way, 'durable')} | {cell(way, 'load')} |"
        for way in ("dcp_disk", "dcp_disk_default", "dcp_st")
    ] + [
        f"| {LABELS['sharded']} | {cell('sharded', 'stall')} | {cell('sharded', 'durable')} | "
        f"cluster {cell('sharded_cluster', 'load')}, local tier "
        f"{cell('sharded_local', 'load')} |",
    ]
    many = "median (min-max) of " if len(result["runs"]) > 1 else ""
    return "\n".join(
        [
            f"{result['state_bytes'] / MIB:.0f} MiB FSDP2 state over {RANKS} ranks "
            f"({result['tensors_per_rank']} tensors a rank), {len(result['runs'])} run(s); "
            f"seconds, {many}the slowest rank",
            "",
            "| | stall | durable | load |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
            f"save_sharded's own part committed (handle.result()): "
            f"{cell('sharded', 'part_committed')} s; warm-up (first, tiny) saves: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in result["warm_up"].items()),
        ]
    )


def under_replicated(env: dict[str, str]) -> int:
    """Committed shards with fewer live copies than R, as `smoltorrent status` counts them."""
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(done.stdout)["summary"]["under_replicated_shards"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024.0, help="state size, MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--json", help="write the runs and medians here")
    parser.add_argument("--scratch", help="where the cluster and DCP's files live (TMPDIR)")
    parser.add_argument("--ranks-out", help=argparse.SUPPRESS)  # set for the ranks
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ranks_out:
        run_ranks(args)
        return 0
    started = time.time()
    with (
        tempfile.TemporaryDirectory(prefix="smoltorrent-dcp-bench-", dir=args.scratch) as tmp,
        registered_cluster(Path(tmp) / "cluster", args.nodes, host_id="bench") as cluster,
    ):
        measured_on = machine(tmp)
        out = Path(tmp) / "ranks.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={RANKS}",
                "-m",
                "bench.dcp_side_by_side",
                "--ranks-out",
                str(out),
                "--dir",
                str(Path(tmp) / "dcp"),
                "--size-mb",
                str(args.size_mb),
                "--repeat",
                str(args.repeat),
            ],
            # One torch thread a rank: 2 ranks on the box's 2 cores.
            env={**cluster.env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            timeout=3600,
        )
        if proc.returncode != 0:
            raise SystemExit(f"the ranks failed (torchrun exit {proc.returncode})")
        result = json.loads(out.read_text())
        result["under_replicated_shards_after"] = under_replicated(cluster.env())
    result["summary"] = summary(result["runs"])
    print(table(result))
    print(f"committed shards short of R=2 after the run: {result['under_replicated_shards_after']}")
    record = {
        "commit": head_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "seconds": time.time() - started,
        "machine": measured_on,
        "args": {k: v for k, v in vars(args).items() if k not in ("ranks_out", "dir")},
        "load_average_after": os.getloadavg(),
        "result": result,
    }
    if args.json:
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
