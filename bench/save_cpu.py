"""What a background save costs the training box (issue 39 item 6): CPU seconds by process
per smoltorrent.save(wait=False) of a ~150 MB state, and how much longer the training
steps right after it take.

    .venv/bin/python -m bench.save_cpu [--mib 147] [--saves 5] [--encode auto|zstd|raw]
                                       [--writer-nice N] [--worker-nice N]
                                       [--profile] [--json OUT]

A local cluster (redis-server, --nodes node processes, a Celery worker; R=2) is started
once; a child process plays the training script. Its step is a fixed CPU load on
--threads torch threads (default: every core, as torch's default; matmuls of 384x384
fp32), so a step that takes longer was slowed by what else ran on the machine's cores.
It runs --baseline steps
with no save (the baseline median), then per save: every tensor of the state changed
(not timed: a training step's update), save(wait=False), two steps timed at once (the
steps the issue measured: +0.35 to +1.03 s for DCP's +0.20 to +0.33 s, on 2 cores
shared with the nodes), handle.result(), then --quiet steps so the next save starts on
a quiet machine.

Per save, CPU seconds (user + system) of each process over the save, from its call to
handle.result(): the training process (getrusage RUSAGE_SELF, which counts its threads),
its writer process (smoltorrent/snapshot_writer.py; /proc/PID/stat), the Celery worker
and its pool (every process of its group), the nodes and Redis. On a real training box
the nodes are elsewhere: the trainer, its writer and the worker are the training box's
share; the nodes run at nice 19 (--nodes-nice), the nearest 2 shared cores come to
nodes on other machines. --encode sets the worker's SMOLTORRENT_ENCODE: here every
node is on loopback, so auto sends chunks RAW; zstd is what a store to LAN nodes does
(auto, nodes elsewhere).

The training process's CPU is given twice: its save() call (the snapshot's copy, the
journal record), and all of it over the save beyond its steps' baseline CPU, which also
counts the step's threads spinning longer when another process holds a core (torch's
OpenMP threads wait busy). The box's CPU sums the call, the writer and the worker.

The writer runs at nice 10 with its session's autogroup (smoltorrent/priority.py);
--writer-nice N sets SMOLTORRENT_WRITER_NICE for the training process (0: the writer at
the trainer's priority, as before it was lowered), so one run is the A side of an A/B and
another the B side. Per save, staged is the time from the call until the writer said the
staged file is fsync'd (its snapshot handed back): until then a power cut loses the
save. The writer's nice value and autogroup's, read from /proc, are in the result.
--worker-nice N lowers the worker the same way once it runs (every process of its group
and its session's autogroup), what a training box could do to its own worker.

--profile runs cProfile over the training process's save() calls and prints its top
functions by own time, so the trainer's share can be read function by function.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/save_cpu.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.local_cluster import registered_cluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

TRAINING_SCRIPT = r"""
import cProfile, io, json, os, pstats, resource, statistics, sys, time
import torch
import smoltorrent
from smoltorrent import api

mib, saves, baseline, quiet, profile = (float(sys.argv[1]), int(sys.argv[2]),
                                        int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
groups = json.loads(sys.argv[6])  # {"worker": pgid, "nodes": [pid], "redis": [pid]}
torch.set_num_threads(int(sys.argv[7]))
torch.manual_seed(0)
TICK = os.sysconf("SC_CLK_TCK")

# An LLM-ish state: fp32 parameters of 1M elements each and AdamW's two moments.
per = 1 << 20  # elements of one tensor (4 MiB)
count = max(1, round(mib * (1 << 20) / (4 * per) / 3))
model = {f"layers.{i}.weight": torch.randn(per // 1024, 1024) for i in range(count)}
state = {"model": model,
         "optim": {"exp_avg": {k: torch.zeros_like(v) for k, v in model.items()},
                   "exp_avg_sq": {k: torch.zeros_like(v) for k, v in model.items()}},
         "step": 0}
size = 3 * count * per * 4
a = torch.randn(384, 384)

def step():
    x = a
    for _ in range(200):
        x = torch.tanh(x @ a)
    return float(x[0, 0])

def cpu_self():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def proc_cpu(pid):
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime

def group_cpu(pgid):
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                total += (int(fields[11]) + int(fields[12])) / TICK
    return total

# When the writer says a save's staged file is fsync'd it hands its snapshot buffer back
# to the pool: the time of that put is the time the save became durable on disk.
pool = api._writer(api._staging_dir(None)).pool
staged_at = []
put = pool.put
def timed_put(buffer):
    staged_at.append(time.perf_counter())
    put(buffer)
pool.put = timed_put

def others():
    writer = next(iter(api._writers.values())).proc if api._writers else None
    return {"writer": proc_cpu(writer.pid) if writer else 0.0,
            "worker": group_cpu(groups["worker"]),
            "nodes": sum(proc_cpu(p) for p in groups["nodes"]),
            "redis": sum(proc_cpu(p) for p in groups["redis"])}

def timed_step():
    c, t = cpu_self(), time.perf_counter()
    step()
    return time.perf_counter() - t, cpu_self() - c

step()
base = [timed_step() for _ in range(baseline)]
base_time = statistics.median(t for t, _ in base)
base_cpu = statistics.median(c for _, c in base)
profiler = cProfile.Profile() if profile else None
runs = []
for i in range(saves + 1):  # the first save starts the writer: a warm-up, not counted
    with torch.no_grad():
        for group in (model, state["optim"]["exp_avg"], state["optim"]["exp_avg_sq"]):
            for t in group.values():
                t.add_(0.001)
    state["step"] = i
    before = others()
    del staged_at[:]
    c0, t0 = cpu_self(), time.perf_counter()
    if profiler:
        profiler.enable()
    handle = smoltorrent.save(state, "bench/cpu", wait=False)
    if profiler:
        profiler.disable()
    stall, call_cpu = time.perf_counter() - t0, cpu_self() - c0
    after = [timed_step() for _ in range(2)]
    handle.result()
    stored = time.perf_counter() - t0
    trainer = cpu_self() - c0 - sum(c for _, c in after)  # less the steps' own CPU
    spent = {k: v - before[k] for k, v in others().items()}
    run = {"stall": stall, "staged": staged_at[0] - t0 if staged_at else None,
           "stored": stored, "trainer_call_cpu": call_cpu,
           "trainer_cpu": trainer + sum(c - base_cpu for _, c in after),
           "steps_after": [t for t, _ in after],
           "delta_two_steps": sum(t for t, _ in after) - 2 * base_time, **spent}
    run["box_cpu"] = run["trainer_call_cpu"] + run["writer"] + run["worker"]
    if i:
        runs.append(run)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()}),
          file=sys.stderr, flush=True)
    for _ in range(quiet):
        step()
writer = next(iter(api._writers.values())).proc.pid
stat = open(f"/proc/{writer}/stat").read().rsplit(")", 1)[1].split()
try:
    autogroup = open(f"/proc/{writer}/autogroup").read().strip()
except OSError:
    autogroup = None
out = {"writer_nice": int(stat[16]), "writer_autogroup": autogroup,
       "size": size, "tensors": 3 * count, "base_step": base_time, "base_step_cpu": base_cpu,
       "runs": runs, "pids": {"trainer": os.getpid(), "writer": writer, **groups}}
if profiler:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    out["profile"] = text.getvalue()
print(json.dumps(out))
"""

KEYS = (
    "stall",
    "staged",
    "stored",
    "trainer_call_cpu",
    "trainer_cpu",
    "writer",
    "worker",
    "box_cpu",
    "nodes",
    "redis",
    "delta_two_steps",
)


def summary(runs: list[dict]) -> dict[str, dict[str, float]]:
    return {
        k: {
            "median": statistics.median(r[k] for r in runs),
            "min": min(r[k] for r in runs),
            "max": max(r[k] for r in runs),
        }
        for k in KEYS
    }


def table(result: dict) -> str:
    s = result["summary"]

    def cell(key: str) -> str:
        m = s[key]
        return f"{m['median']:.2f} ({m['min']:.2f} to {m['max']:.2f})"

    return "\n".join(
        [
            f"{result['size'] / MIB:.0f} MiB state ({result['tensors']} fp32 tensors), "
            f"encode={result['encode']}, {len(result['runs'])} saves, {result['threads']} "
            f"torch threads; writer at nice {result['writer_nice']} "
            f"({result['writer_autogroup']}); baseline step "
            f"{result['base_step']:.3f} s; seconds, median (min to max)",
            "",
            "| | per save |",
            "| --- | --- |",
            f"| stall (save() call) | {cell('stall')} |",
            f"| staged (call to the staged file fsync'd) | {cell('staged')} |",
            f"| stored (call to handle.result()) | {cell('stored')} |",
            f"| training process CPU, the call | {cell('trainer_call_cpu')} |",
            f"| training process CPU beyond its steps' baseline | {cell('trainer_cpu')} |",
            f"| writer process CPU | {cell('writer')} |",
            f"| worker CPU (store, hashing, sends) | {cell('worker')} |",
            f"| training box CPU (call, writer, worker) | {cell('box_cpu')} |",
            f"| nodes CPU (elsewhere on a real cluster) | {cell('nodes')} |",
            f"| Redis CPU | {cell('redis')} |",
            f"| the two steps after it, beyond 2 baseline steps | {cell('delta_two_steps')} |",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=147.0, help="state size, MiB")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--baseline", type=int, default=8, help="steps timed with no save")
    parser.add_argument("--quiet", type=int, default=3, help="steps between saves")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads of the step"
    )
    parser.add_argument(
        "--nodes-nice", type=int, default=19, help="the nodes' nice value (0: as the rest)"
    )
    parser.add_argument(
        "--writer-nice",
        type=int,
        help="SMOLTORRENT_WRITER_NICE for the training process (0: the writer as the "
        "trainer; default: smoltorrent's)",
    )
    parser.add_argument(
        "--worker-nice",
        type=int,
        default=0,
        help="the worker's nice value and its session autogroup's, set once it runs (0: "
        "left as started); what a training box could do to its worker",
    )
    parser.add_argument("--encode", default="auto", choices=("auto", "zstd", "raw"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", help="write the runs and medians here")
    parser.add_argument("--scratch", help="where the cluster lives (default: TMPDIR)")
    args = parser.parse_args()
    writer_env = (
        {} if args.writer_nice is None else {"SMOLTORRENT_WRITER_NICE": str(args.writer_nice)}
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    with (
        tempfile.TemporaryDirectory(prefix="smoltorrent-save-cpu-", dir=args.scratch) as tmp,
        registered_cluster(
            Path(tmp) / "cluster",
            args.nodes,
            host_id="bench",
            extra_env={"SMOLTORRENT_ENCODE": args.encode},
            # Nodes are elsewhere on a real cluster: here they take only what the training
            # box leaves (nice 19), so they slow its steps as little as they can on 2 cores.
            node_launcher=("nice", "-n", str(args.nodes_nice)) if args.nodes_nice else (),
        ) as cluster,
    ):
        assert cluster.worker is not None
        if args.worker_nice:
            # Every thread of every process in its group (PRIO_PGRP), and its session's
            # autogroup: as smoltorrent/priority.py lowers the writer.
            os.setpriority(os.PRIO_PGRP, cluster.worker.pid, args.worker_nice)
            Path(f"/proc/{cluster.worker.pid}/autogroup").write_text(str(args.worker_nice))
        groups = {
            "worker": cluster.worker.pid,  # its own session: its group is its pid
            "nodes": [n.pid for n in cluster.node_procs],
            "redis": [cluster.redis_pid],
        }
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                TRAINING_SCRIPT,
                str(args.mib),
                str(args.saves),
                str(args.baseline),
                str(args.quiet),
                "1" if args.profile else "0",
                json.dumps(groups),
                str(args.threads),
            ],
            env=dict(
                cluster.env(),
                PYTHONPATH=str(ROOT),
                **writer_env,
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            timeout=3600,
        )
    if proc.returncode != 0:
        raise SystemExit(f"the training process failed (exit {proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(
        encode=args.encode,
        threads=args.threads,
        summary=summary(result["runs"]),
    )
    print(json.dumps(result["pids"]))
    print(table(result))
    if "profile" in result:
        print(result["profile"])
    record = {
        "commit": commit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "args": vars(args),
        "load_average_after": os.getloadavg(),
        "result": result,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
