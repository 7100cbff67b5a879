"""Store and gather throughput and coordinator memory, against a raw sendfile reference.

    .venv/bin/python -m bench.store_gather --size-gb 1 4 [--celery] [--json]

For each size: build a synthetic LLM-like checkpoint, start N shard servers
(separate processes, loopback), then time in fresh child processes (so the
peak RSS, the child's VmHWM, is the coordinator's alone):
  plan    prepare_store alone (header, plan, SHA-256 of every shard): the part
          of the store that reads the source before any byte is sent
  store   store_checkpoint (plan, hash, send every replica, manifest)
  gather  gather_checkpoint (pull, hash, pwrite, fsync, rename)
  raw     the same ranges x replicas moved by plain sendfile into N raw socket
          servers that write and fsync (bench/raw_reference.py), and back.
  hashed raw  the same plus SHA-256 once at the source, at each node and at the
          gatherer: the floor for anything that verifies what it moves.
With --celery, the same store and gather through a LocalCluster and the CLI.

Honesty notes: the source file was just written, so every read of it comes
from the page cache (caches are not dropped: that needs root and is not
reliable in a container); node writes are fsynced, so the disk is in the
measurement. os.sync() runs between phases so that one phase's dirty pages
are not flushed on the next one's clock.
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/store_gather.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import report  # noqa: E402
from coordinator.dataplane.node_client import NodeClient  # noqa: E402
from coordinator.local.cluster import LocalCluster, NodeProcess  # noqa: E402
from coordinator.local.synthetic import write_checkpoint  # noqa: E402
from coordinator.plan.manifest import Manifest  # noqa: E402
from coordinator.plan.read_order import read_order  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GB = 1_000_000_000  # decimal, like the MB/s figures


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_child(spec: dict, scratch: Path, timeout: float) -> dict:
    """Run bench.child on spec; its timing, its own peak RSS and its result.

    The peak RSS is the child's VmHWM, read by the child itself at the end. Not
    wait4/RUSAGE_CHILDREN: on Linux a child's ru_maxrss starts from the RSS of
    the process it was forked (vforked, for subprocess) from, so it would report
    this bench's own footprint whenever that is the larger one.
    """
    spec_path, result_path = scratch / f"{spec['op']}.spec.json", scratch / f"{spec['op']}.out"
    spec_path.write_text(json.dumps({**spec, "result": str(result_path)}))
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.child", str(spec_path)],
        stdout=subprocess.PIPE,
        env=child_env(),
        cwd=ROOT,
    )
    try:
        line, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"bench child {spec['op']} failed (exit {proc.returncode})")
    timing = json.loads(line)
    result = json.loads(result_path.read_text())
    spec_path.unlink()
    result_path.unlink()
    return {
        "seconds": timing["seconds"],
        "process_wall_s": wall,  # with interpreter start-up and imports
        "peak_rss_mb": timing["hwm_kb"] / 1024,
        "rss_before_mb": timing["rss_before_kb"] / 1024,
        "result": result,
    }


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(1 << 20)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def check_same(path: Path, digest: str, what: str) -> None:
    if sha256_file(path) != digest:
        raise RuntimeError(f"{what}: {path} is not byte-identical to the source")
    path.unlink()


def start_raw_nodes(root: Path, count: int) -> list[tuple[subprocess.Popen, int]]:
    nodes = []
    for i in range(count):
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.raw_reference", "serve", str(root / f"raw{i}")],
            stdout=subprocess.PIPE,
            env=child_env(),
            cwd=ROOT,
            text=True,
        )
        nodes.append((proc, int(proc.stdout.readline())))
    return nodes


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


def phase(label: str) -> None:
    os.sync()  # flush the previous phase's dirty pages before the next clock starts
    log(label)


def twice(label: str, spec: dict, out: Path, digest: str, root: Path, timeout: float):
    """A gather, then the same gather again: (cold, warm).

    This machine is a Firecracker VM: the first run that fills fresh page cache
    can spend seconds in the kernel (first touch of guest memory, no disk I/O),
    an immediate repeat does not. Both are reported; ratios use the warm runs.
    """
    runs = []
    for attempt in ("cold", "warm"):
        phase(f"{label}, {attempt}")
        runs.append(run_child(spec, root, timeout))
        check_same(out, digest, label)
    return runs


def measure_direct(source: Path, digest: str, args, root: Path, timeout: float) -> dict:
    out: dict = {}
    nodes = [NodeProcess(root / f"node{i}", env=child_env()).start() for i in range(args.nodes)]
    raw: list[tuple[subprocess.Popen, int]] = []
    try:
        addresses = [str(n.address) for n in nodes]
        index_of = {NodeClient(n.address).ping(): i for i, n in enumerate(nodes)}
        phase("plan + hash only (the store's first phase)")
        out["plan"] = run_child(
            {"op": "plan", "source": str(source), "nodes": args.nodes, "replicas": args.replicas},
            root,
            timeout,
        )
        phase("store (direct engine)")
        store = run_child(
            {
                "op": "store",
                "source": str(source),
                "addresses": addresses,
                "replicas": args.replicas,
            },
            root,
            timeout,
        )
        manifest = Manifest.from_json(store["result"]["manifest"])
        holders = [
            [index_of[n] for n in store["result"]["holders"][str(i)]]
            for i in range(len(manifest.shards))
        ]
        if store["result"]["errors"] or any(len(h) < args.replicas for h in holders):
            raise RuntimeError(f"store was under-replicated: {store['result']['errors']}")
        manifest_path = root / "manifest.json"
        manifest_path.write_text(store["result"]["manifest"])
        out["store"] = store

        gathered = root / "gathered.safetensors"
        spec = {
            "op": "gather",
            "manifest": str(manifest_path),
            "out": str(gathered),
            # The replica each shard is read from, chosen as the Celery gather does.
            "sources": read_order(
                [[addresses[n] for n in h] for h in holders],
                [s.blob_size for s in manifest.shards],
                set(addresses),
            ),
        }
        out["gather_cold"], gather = twice(
            "gather (direct engine)", spec, gathered, digest, root, timeout
        )
        out["gather"] = gather
        served = {a: i for i, a in enumerate(addresses)}
        served_by = [
            served[gather["result"]["served_by"][str(i)]] for i in range(len(manifest.shards))
        ]

        # The same byte ranges, the same nodes, the same parallelism, nothing else.
        # (A node gets each shard file once: raw files are named by shard index.)
        ranges = [
            (manifest.data_start + s.data_start, s.data_end - s.data_start) for s in manifest.shards
        ]
        log(f"placement {holders}, gather served by {served_by}")
        raw = start_raw_nodes(root, args.nodes)
        ports = [port for _, port in raw]
        phase("raw reference store (sendfile -> recv, write, fsync)")
        out["raw_store"] = run_child(
            {
                "op": "raw_store",
                "source": str(source),
                "ranges": ranges,
                "targets": holders,
                "ports": ports,
            },
            root,
            timeout,
        )
        raw_out = root / "raw-gathered.safetensors"
        spec = {
            "op": "raw_gather",
            "source": str(source),
            "out": str(raw_out),
            "size": manifest.source_size,
            "header_len": manifest.data_start,
            "ranges": ranges,
            "served_by": served_by,
            "ports": ports,
        }
        out["raw_gather_cold"], out["raw_gather"] = twice(
            "raw reference gather (sendfile -> recv, pwrite)", spec, raw_out, digest, root, timeout
        )
        # The same again with the one check smoltorrent cannot drop, SHA-256 at the source,
        # at every node and at the gatherer: what hashing alone costs on this machine.
        phase("hashed raw reference store (+ SHA-256 at the source and every node)")
        out["raw_hashed_store"] = run_child(
            {
                "op": "raw_store",
                "source": str(source),
                "ranges": ranges,
                "targets": holders,
                "ports": ports,
                "hashed": True,
            },
            root,
            timeout,
        )
        _, out["raw_hashed_gather"] = twice(
            "hashed raw reference gather (+ SHA-256 of what arrives)",
            {**spec, "hashed": True},
            raw_out,
            digest,
            root,
            timeout,
        )
        out["shards"] = len(manifest.shards)
    finally:
        stop([p for p, _ in raw])
        for node in nodes:
            node.stop()
        for path in [*root.glob("node*"), *root.glob("raw*")]:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink()
    return out


def cli(env: dict[str, str], timeout: float, *argv: str) -> tuple[float, dict | list]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv, "--json"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        why = done.stderr.strip() or done.stdout.strip()
        raise RuntimeError(f"smoltorrent {' '.join(argv)} failed: {why}")
    return seconds, json.loads(done.stdout)


def measure_celery(source: Path, digest: str, args, root: Path, timeout: float) -> dict:
    # As installed: bytecode for the project's modules (a checkout edited since bootstrap,
    # under PYTHONDONTWRITEBYTECODE, would compile them again in every CLI run).
    for package in ("smoltorrent", "coordinator", "worker_server", "tasks", "beat"):
        compileall.compile_dir(ROOT / package, quiet=1)
    cluster = LocalCluster(root / "celery", nodes=args.nodes, host_id=f"bench-{os.getpid()}")
    try:
        log("starting a LocalCluster (redis, nodes, Celery worker)")
        cluster.start(worker=True)
        env = child_env(cluster.env())
        cli(env, 60, "nodes", "add", *(str(n.address) for n in cluster.node_procs))
        phase("store (Celery, CLI)")
        store_s, stored = cli(env, timeout, "store", str(source), "--replicas", str(args.replicas))
        phase("gather (Celery, CLI)")
        # The worker writes gathers only under the directories it allows (safe defaults):
        # the cluster's own is one.
        gathered = cluster.root / "celery-gathered.safetensors"
        gather_s, report_ = cli(env, timeout, "gather", source.name, "-o", str(gathered))
        check_same(gathered, digest, "celery gather")
        phase("gather (CLI, in its own process)")
        # Outside every directory the worker writes: the CLI gathers itself, as a user's
        # `smoltorrent gather NAME -o ./model.safetensors` does.
        reader = root / "reader-out"
        reader.mkdir(exist_ok=True)
        mine = reader / "gathered.safetensors"
        reader_s, reader_report = cli(env, timeout, "gather", source.name, "-o", str(mine))
        check_same(mine, digest, "in-process gather")
        return {
            "store": {"seconds": store_s, "under_replicated": stored["under_replicated"]},
            "gather": {"seconds": gather_s, "task_seconds": report_["seconds"]},
            "reader_gather": {"seconds": reader_s, "task_seconds": reader_report["seconds"]},
        }
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


def measure_size(size_gb: float, args, root: Path) -> dict:
    source = root / f"model-{size_gb:g}gb.safetensors"
    log(f"building a {size_gb:g} GB synthetic checkpoint")
    size = write_checkpoint(source, int(size_gb * GB))
    digest = sha256_file(source)
    timeout = 600 + 300 * size / GB
    runs = []
    try:
        # Fresh nodes every run: a second store of the same bytes would move nothing.
        for run in range(args.repeat):
            log(f"{size_gb:g} GB, run {run + 1} of {args.repeat}")
            row = measure_direct(source, digest, args, root, timeout)
            if args.celery:
                row["celery"] = measure_celery(source, digest, args, root, timeout)
            runs.append(row)
    finally:
        source.unlink()
    return {"size_gb": size_gb, "size_bytes": size, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.store_gather",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--size-gb",
        type=float,
        nargs="+",
        action="extend",
        help="checkpoint size(s) in GB (10^9 bytes); repeatable (default 1)",
    )
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--celery",
        action="store_true",
        help="also store and gather through a LocalCluster and the CLI",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per size; the table shows medians"
    )
    parser.add_argument("--json", action="store_true", help="a JSON summary on stdout")
    parser.add_argument("--workdir", type=Path, help="parent of the scratch dir (default /tmp)")
    args = parser.parse_args(argv)
    sizes = args.size_gb or [1.0]
    root = Path(tempfile.mkdtemp(prefix="smoltorrent-bench-", dir=args.workdir or "/tmp"))
    log(f"scratch dir {root} (removed at the end)")
    try:
        rows = [measure_size(size, args, root) for size in sizes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = report.summarize(rows, args, " ".join(sys.argv))
    print(report.table(summary), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
