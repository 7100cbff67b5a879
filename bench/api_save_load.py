"""Saving and loading a training state side by side (issue 23): torch.save, safetensors
save_file, torch.distributed.checkpoint (DCP) save and async_save, and smoltorrent.save
with wait=True and wait=False, for a model with AdamW (parameters and both moments, fp32)
of --sizes GiB each.

    .venv/bin/python -m bench.api_save_load [--sizes 1,4] [--repeat 3] [--json OUT]

A local cluster (redis-server, 4 node processes, a Celery worker; R=2) is started once;
each size runs in a child process of its own, which plays the training script: it builds
a transformer-ish stack of fp32 layers (embedding, per layer qkv, out, up and down
projections and two norms) sized so that parameters plus AdamW's two moments reach the
size, runs one forward, backward and optimizer.step() so the moments exist, and drops the
gradients. Then, per repeat (every tensor of the state changed first, so every save
writes new bytes; each measurement starts once the one before is on disk and synced):

  copy        an in-memory copy of every tensor: clone() ("fresh": new memory on the
              first run; later runs get blocks the allocator kept from the run before),
              and copy_() into buffers whose pages are already touched ("reused"). The
              stall target of smoltorrent.save(wait=False) is at most 1.2x the copy.
  torch.save  {"model", "optim", "step"} to a file; stored = + fsync of the file
  safetensors save_file of the flat tensors; stored = + fsync
  dcp         torch.distributed.checkpoint.save, FileSystemWriter (fsyncs its files)
  dcp_async   torch.distributed.checkpoint.async_save, FileSystemWriter, the default
              (thread) checkpointer: stall = until it returns, stored = its future's end
  st_wait     smoltorrent.save(state, wait=True): stall = stored = committed at R
  st_async    smoltorrent.save(state, wait=False): stall = until it returns, stored = until
              handle.result() (committed at R on the nodes)

Loads, each timed until every byte of the state is in memory (one byte of every page
read after the call: safetensors' load_file maps the file and reads lazily): torch.load
(weights_only), safetensors load_file, dcp.load into freshly allocated tensors, and
smoltorrent.load(name, source="local") (this machine's kept copy, every byte checked
against the manifest) and source="cluster" (gathered from the nodes and verified). Every
file read is in the page cache (written just before; the VM's RAM holds it), so the loads
are warm. DCP runs in one process with no process group (DCP saves as one process then).

The stall is the time the calling (training) thread is blocked; background work of the
async saves still takes CPU from the 2 cores while it runs, which a training step would
feel and this bench does not time. Medians of --repeat runs; every run is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/api_save_load.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.local_cluster import registered_cluster  # noqa: E402
from bench.report import head_commit, machine, write_json  # noqa: E402
from coordinator.local.cluster import LocalCluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30

TRAINING_SCRIPT = r"""
import gc, json, os, shutil, subprocess, sys, time
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.utils._pytree import tree_leaves, tree_map
import safetensors.torch
import smoltorrent
import warnings

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
gib, repeat, scratch = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
hidden, vocab = 1024, 32000
per_layer = 12 * hidden * hidden + 4 * hidden  # qkv, out, up, down; two norms
params_wanted = gib * (1 << 30) / 12  # fp32 parameter + two fp32 moments: 12 bytes each
layers = max(1, round((params_wanted - vocab * hidden) / per_layer))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / hidden**0.5, dim=-1) @ v
        x = x + self.out(attn)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x @ self.embed.weight.T


model = Model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
tokens = torch.randint(0, vocab, (2, 16))
loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
loss.backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)
del loss
gc.collect()


def state():
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 1}


def flat():
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in s.items()})
    return out


tensors = list(flat().values())
size = sum(t.numel() * t.element_size() for t in tensors)


def bump():
    # Every tensor's bytes change (the step counts too), so no save repeats the one before.
    with torch.no_grad():
        for t in tensors:
            t.add_(1)


def durable(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def touch(loaded):
    # A load may hand back tensors mapped from the file (safetensors' load_file does), whose
    # bytes are read on first use: read one byte of every page, so each load is timed to
    # the state in memory.
    for v in tree_leaves(loaded):
        if isinstance(v, torch.Tensor) and v.numel():
            v.reshape(-1).view(torch.uint8)[::4096].sum()


def settle():
    gc.collect()
    os.sync()


def cli(*argv):
    subprocess.run([sys.executable, "-m", "coordinator.cli", *argv], check=True,
                   capture_output=True)


smoltorrent.save({"warm": torch.zeros(1)}, "bench/warmup")  # imports, writer, connections
# The first save of this size: its snapshot goes into fresh shared memory (a page fault per
# page); later saves reuse that buffer, as a training loop's saves do. Its reference is a
# clone into fresh memory just before, under the same memory pressure (the first clone of
# the process: the allocator has no freed blocks to hand back yet).
t0 = time.perf_counter()
copied = [t.clone() for t in tensors]
first = {"copy_cold": time.perf_counter() - t0}
del copied
gc.collect()
t0 = time.perf_counter()
handle = smoltorrent.save(state(), "bench/first", wait=False)
first["stall"] = time.perf_counter() - t0
handle.result()
first["stored"] = time.perf_counter() - t0
cli("rm", "bench/first", "--yes")
settle()
runs = []
for r in range(repeat):
    run = {}
    bump()
    t0 = time.perf_counter()
    copied = [t.clone() for t in tensors]
    run["copy_fresh"] = time.perf_counter() - t0
    del copied
    kept = [torch.empty_like(t) for t in tensors]
    for k, t in zip(kept, tensors):
        k.copy_(t)  # their pages touched once, as a buffer kept between saves is
    bump()
    t0 = time.perf_counter()
    for k, t in zip(kept, tensors):
        k.copy_(t)
    run["copy_reused"] = time.perf_counter() - t0
    del kept  # not held through the saves: the 4 GiB run's memory stays under 24 GiB
    settle()

    bump()
    path = os.path.join(scratch, "torch.pt")
    t0 = time.perf_counter()
    torch.save(state(), path)
    run["torch_save_stall"] = time.perf_counter() - t0
    durable(path)
    run["torch_save_stored"] = time.perf_counter() - t0
    settle()
    t0 = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    touch(loaded)
    run["torch_save_load"] = time.perf_counter() - t0
    del loaded
    os.unlink(path)
    settle()

    bump()
    path = os.path.join(scratch, "flat.safetensors")
    t0 = time.perf_counter()
    safetensors.torch.save_file(flat(), path)
    run["safetensors_stall"] = time.perf_counter() - t0
    durable(path)
    run["safetensors_stored"] = time.perf_counter() - t0
    settle()
    t0 = time.perf_counter()
    loaded = safetensors.torch.load_file(path)
    touch(loaded)
    run["safetensors_load"] = time.perf_counter() - t0
    del loaded
    os.unlink(path)
    settle()

    for kind in ("dcp", "dcp_async"):
        bump()
        msd, osd = get_state_dict(model, optimizer)
        sd = {"model": msd, "optim": osd}
        where = os.path.join(scratch, kind)
        t0 = time.perf_counter()
        if kind == "dcp":
            dcp.save(sd, storage_writer=FileSystemWriter(where))
            run[f"{kind}_stall"] = time.perf_counter() - t0
        else:
            future = dcp.async_save(sd, storage_writer=FileSystemWriter(where))
            run[f"{kind}_stall"] = time.perf_counter() - t0
            future.result()
        run[f"{kind}_stored"] = time.perf_counter() - t0
        settle()
        t0 = time.perf_counter()
        into = tree_map(lambda v: torch.empty_like(v) if isinstance(v, torch.Tensor) else v, sd)
        dcp.load(into, checkpoint_id=where)
        touch(into)
        run[f"{kind}_load"] = time.perf_counter() - t0
        del into, sd, msd, osd
        shutil.rmtree(where)
        settle()

    bump()
    t0 = time.perf_counter()
    smoltorrent.save(state(), "bench/wait", wait=True)
    run["st_wait_stall"] = run["st_wait_stored"] = time.perf_counter() - t0
    settle()

    bump()
    t0 = time.perf_counter()
    handle = smoltorrent.save(state(), "bench/async", wait=False)
    run["st_async_stall"] = time.perf_counter() - t0
    saved = handle.result()
    run["st_async_stored"] = time.perf_counter() - t0
    settle()
    for source in ("local", "cluster"):
        t0 = time.perf_counter()
        loaded = smoltorrent.load("bench/async", source=source)
        touch(loaded)
        run[f"st_load_{source}"] = time.perf_counter() - t0
        del loaded
        settle()
    run["st_size"] = saved.size
    # Only the latest versions are kept: the nodes' disks hold R copies of every version.
    cli("rm", "bench/wait", "--yes")
    cli("rm", "bench/async", "--yes")
    runs.append(run)
    print(json.dumps(run), file=sys.stderr, flush=True)

print(json.dumps({"size": size, "tensors": len(tensors), "layers": layers,
                  "params": sum(p.numel() for p in model.parameters()), "first_save": first,
                  "runs": runs}))
"""

# (row label, stall key, stored key, load keys) in the table's order
METHODS = (
    ("torch.save", "torch_save_stall", "torch_save_stored", ("torch_save_load",)),
    ("safetensors save_file", "safetensors_stall", "safetensors_stored", ("safetensors_load",)),
    ("DCP save", "dcp_stall", "dcp_stored", ("dcp_load",)),
    ("DCP async_save", "dcp_async_stall", "dcp_async_stored", ("dcp_async_load",)),
    ("smoltorrent.save(wait=True)", "st_wait_stall", "st_wait_stored", ()),
    (
        "smoltorrent.save(wait=False)",
        "st_async_stall",
        "st_async_stored",
        ("st_load_local", "st_load_cluster"),
    ),
)


def medians(runs: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "first": values[0],
        }
    return out


def run_size(cluster: LocalCluster, gib: float, repeat: int, scratch: Path) -> dict:
    env = dict(cluster.env(), PYTHONPATH=str(ROOT))
    scratch.mkdir(parents=True, exist_ok=True)
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", TRAINING_SCRIPT, str(gib), str(repeat), str(scratch)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=None,  # the per-run lines show as they come
        text=True,
        timeout=4 * 3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the {gib} GiB run failed (exit {proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["gib"] = gib
    result["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
    result["seconds"] = time.time() - started
    result["load_average_after"] = os.getloadavg()
    result["summary"] = medians(result["runs"])
    return result


def table(result: dict) -> str:
    s = result["summary"]
    size = result["size"]

    def cell(key: str) -> str:
        m = s[key]
        return f"{m['median']:.2f} ({m['min']:.2f}-{m['max']:.2f})"

    def speed(key: str) -> str:
        return f"{size / GIB / s[key]['median']:.2f} GiB/s"

    copy_fresh, copy_reused = s["copy_fresh"]["median"], s["copy_reused"]["median"]
    lines = [
        f"{size / GIB:.2f} GiB state: {result['params'] / 1e6:.0f}M fp32 parameters + AdamW "
        f"moments, {result['tensors']} tensors ({result['layers']} layers), "
        f"{len(result['runs'])} runs; seconds, median (min-max)",
        "",
        "| | stall | stored | load |",
        "| --- | --- | --- | --- |",
        f"| in-memory copy, clone() | {cell('copy_fresh')} | | |",
        f"| in-memory copy, copy_() into kept buffers | {cell('copy_reused')} | | |",
    ]
    for label, stall, stored, loads in METHODS:
        if loads == ("st_load_local", "st_load_cluster"):
            load = (
                f"local tier {cell('st_load_local')} ({speed('st_load_local')}); "
                f"cluster {cell('st_load_cluster')} ({speed('st_load_cluster')})"
            )
        else:
            load = cell(loads[0]) if loads else ""
        lines.append(f"| {label} | {cell(stall)} | {cell(stored)} | {load} |")
    stall = s["st_async_stall"]["median"]
    lines += [
        "",
        f"smoltorrent.save(wait=False) stall: {stall / copy_fresh:.2f}x the clone, "
        f"{stall / copy_reused:.2f}x the copy into touched buffers (target at most 1.2x the "
        "copy); "
        f"the first save of this size (fresh shared memory): stall "
        f"{result['first_save']['stall']:.2f} s against {result['first_save']['copy_cold']:.2f}"
        f" s for a clone into fresh memory just before "
        f"({result['first_save']['stall'] / result['first_save']['copy_cold']:.2f}x), stored "
        f"{result['first_save']['stored']:.2f} s; "
        f"DCP async_save stall {s['dcp_async_stall']['median'] / copy_fresh:.2f}x the clone",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4", help="state sizes in GiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--json", help="write the raw runs and medians here")
    parser.add_argument(
        "--scratch", help="where the files, the cluster and its nodes live (default: TMPDIR)"
    )
    args = parser.parse_args()
    sizes = [float(x) for x in args.sizes.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="smoltorrent-api-bench-", dir=args.scratch) as tmp:
        measured_on = machine(tmp)
        with registered_cluster(Path(tmp) / "cluster", args.nodes, host_id="bench") as cluster:
            for gib in sizes:
                result = run_size(cluster, gib, args.repeat, Path(tmp) / "files")
                print(table(result) + "\n", flush=True)
                results.append(result)
    record = {
        "commit": head_commit(),
        "machine": measured_on,
        "args": vars(args),
        "results": results,
    }
    if args.json:
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
