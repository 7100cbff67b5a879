"""The training stall of smoltorrent.save: wait=False against an in-memory copy of the same
tensors (the target: at most 1.2x it), against wait=True and against a plain
safetensors.torch.save_file of the same state dict to the same disk; and the bytes a
partial load of ~10% of the tensors moves.

    .venv/bin/python -m bench.api_save_load [--mib 300] [--repeat 5] [--json OUT]

A local cluster (redis-server, 4 node processes, a Celery worker; R=2) is started, and
one child process plays the training script: it builds a bf16 state dict of about
--mib MiB once, then per repeat (every tensor changed first, so every store moves new
bytes) times
  copy         a clone of every tensor into new memory (what any consistent snapshot
               costs at least)
  plain        safetensors.torch.save_file into SMOLTORRENT_HOME/staging (page cache,
               no fsync: what a training loop's own save costs)
  async_stall  smoltorrent.save(..., wait=False) until it returns: the training stall
  async_commit the same save until handle.result() (local write to committed on nodes)
  sync         smoltorrent.save(..., wait=True)
Each measurement starts once the previous store has committed, so a background store
never runs on the next one's clock. Then it loads ~10% of the tensors with tensors=
and reports the bytes the nodes sent (their own counters) against the checkpoint size.
Medians and min-max of --repeat runs.
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

from coordinator.local.cluster import LocalCluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

TRAINING_SCRIPT = r"""
import json, os, sys, time, urllib.request
import torch
import safetensors.torch
import smoltorrent

mib, repeat, data_dirs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(os.pathsep)
hidden = 2048
rows = 512  # each tensor: 512 x 2048 bf16 = 2 MiB
count = max(1, mib // 2)
gen = torch.Generator().manual_seed(0)
sd = {f"layers.{i}.weight": torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
      for i in range(count)}
size = sum(t.numel() * t.element_size() for t in sd.values())
staging = os.path.join(os.environ["SMOLTORRENT_HOME"], "staging")
os.makedirs(staging, exist_ok=True)

def bump():
    for t in sd.values():
        t.add_(1)

def sent():
    total = 0.0
    for d in data_dirs:
        port = open(os.path.join(d, "metrics_port")).read().strip()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        line = next(x for x in text.splitlines()
                    if x.startswith("smoltorrent_node_bytes_sent_total"))
        total += float(line.split()[-1])
    return total

runs = []
smoltorrent.save({"warm": torch.zeros(1)}, "bench/warmup")  # imports, connections
warm = os.path.join(staging, "warm.safetensors")
safetensors.torch.save_file(sd, warm)  # the writer's first call, and the page cache
os.unlink(warm)
os.sync()
for r in range(repeat):
    bump()
    t0 = time.perf_counter()
    copied = {k: v.clone() for k, v in sd.items()}
    copy = time.perf_counter() - t0
    del copied

    bump()
    path = os.path.join(staging, f"plain-{r}.safetensors")
    t0 = time.perf_counter()
    safetensors.torch.save_file(sd, path)
    plain = time.perf_counter() - t0
    os.unlink(path)
    os.sync()

    bump()
    t0 = time.perf_counter()
    handle = smoltorrent.save(sd, "bench/async.safetensors", wait=False)
    stall = time.perf_counter() - t0
    handle.result()
    commit = time.perf_counter() - t0
    os.sync()

    bump()
    t0 = time.perf_counter()
    smoltorrent.save(sd, "bench/sync.safetensors", wait=True)
    sync = time.perf_counter() - t0
    os.sync()
    runs.append({"copy": copy, "plain": plain, "async_stall": stall, "async_commit": commit,
                 "sync": sync})
    print(json.dumps(runs[-1]), file=sys.stderr, flush=True)

names = sorted(sd)[: max(1, len(sd) // 10)]
before = sent()
t0 = time.perf_counter()
part = smoltorrent.load("bench/sync.safetensors", tensors=names)
partial_s = time.perf_counter() - t0
moved = sent() - before
assert sorted(part) == names
print(json.dumps({"size": size, "tensors": len(sd), "runs": runs,
                  "partial": {"tensors": len(names), "seconds": partial_s, "bytes_sent": moved,
                              "tensor_bytes": sum(sd[n].numel() * 2 for n in names)}}))
"""


def summarize(result: dict) -> dict:
    out = {}
    for key in ("copy", "plain", "async_stall", "async_commit", "sync"):
        values = [r[key] for r in result["runs"]]
        out[key] = {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
        }
    plain = out["plain"]["median_s"]
    out["stall_vs_plain"] = out["async_stall"]["median_s"] / plain
    out["stall_vs_copy"] = out["async_stall"]["median_s"] / out["copy"]["median_s"]
    out["stall_vs_sync"] = out["async_stall"]["median_s"] / out["sync"]["median_s"]
    partial = result["partial"]
    out["partial"] = {**partial, "fraction_of_checkpoint": partial["bytes_sent"] / result["size"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=300, help="state dict size, MiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--json", help="write the raw results and summary here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="smoltorrent-api-bench-") as scratch:
        cluster = LocalCluster(
            Path(scratch) / "cluster",
            nodes=args.nodes,
            host_id="bench",
            extra_env={"SMOLTORRENT_METRICS_PORT": "0"},
        )
        try:
            cluster.start()
            env = dict(cluster.env(), PYTHONPATH=str(ROOT))
            subprocess.run(
                [sys.executable, "-m", "coordinator.cli", "nodes", "add"]
                + [str(n.address) for n in cluster.node_procs],
                env=env,
                check=True,
                capture_output=True,
            )
            data_dirs = os.pathsep.join(str(n.data_dir) for n in cluster.node_procs)
            started = time.time()
            proc = subprocess.run(
                [sys.executable, "-c", TRAINING_SCRIPT, str(args.mib), str(args.repeat), data_dirs],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=3600,
            )
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr)
                return 1
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        finally:
            cluster.stop()
    summary = summarize(result)
    load = os.getloadavg()
    record = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "args": vars(args),
        "load_average_after": load,
        "result": result,
        "summary": summary,
    }
    print(table(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return 0


def table(record: dict) -> str:
    s, r = record["summary"], record["result"]
    lines = [
        f"state dict: {r['size'] / MIB:.0f} MiB bf16 in {r['tensors']} tensors, "
        f"{len(r['runs'])} runs, 4 nodes, R=2",
        "operation                          | median s |  min-max s",
        "-----------------------------------+----------+-----------",
    ]
    for key, label in (
        ("copy", "in-memory copy (clone)"),
        ("plain", "safetensors save_file (baseline)"),
        ("async_stall", "save(wait=False): the stall"),
        ("async_commit", "save(wait=False) to commit"),
        ("sync", "save(wait=True)"),
    ):
        m = s[key]
        lines.append(f"{label:<35}| {m['median_s']:8.2f} | {m['min_s']:.2f}-{m['max_s']:.2f}")
    p = s["partial"]
    lines.append(
        f"stall / in-memory copy: {s['stall_vs_copy']:.2f}x; "
        f"stall / plain save_file: {s['stall_vs_plain']:.2f}x; "
        f"stall / save(wait=True): {s['stall_vs_sync']:.2f}x"
    )
    lines.append(
        f"partial load of {p['tensors']} of {r['tensors']} tensors: "
        f"{p['bytes_sent'] / MIB:.1f} MiB sent by the nodes = "
        f"{100 * p['fraction_of_checkpoint']:.1f}% of the checkpoint "
        f"(selected tensors: {p['tensor_bytes'] / MIB:.1f} MiB), {p['seconds']:.2f} s"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
