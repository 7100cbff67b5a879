"""Memory of the Celery worker's process tree while it stores and gathers checkpoints of
growing size: it must stay flat (the issue's target: peak under 300 MB, within 10% from
1 GB to 16 GB).

    .venv/bin/python -m bench.worker_memory --size-gb 1 4 [--nodes 4] [--json]
        [--worker-env NAME=VALUE ...] [--drop-source]

For each size: a synthetic LLM-like checkpoint (random bytes, written to disk), a fresh
LocalCluster (Redis, N node processes, one Celery worker with its default pool), then
`smoltorrent store` and `smoltorrent gather` through the CLI, as a user runs them. While
each runs, the RSS of the worker's main process and every pool child (/proc, the tree as
it is at each sample) is sampled every 50 ms; the peak of their sum, of their PSS sum (the
pool is forked: RSS counts each shared page once per process, PSS once) and of the largest
process are reported, and the tree's just before the store (the idle worker) for reference.
The gathered file is checked byte-identical, then every file is removed.

--worker-env sets a variable for the worker alone (MALLOC_ARENA_MAX=1, say: the nodes and
the CLI keep theirs). --drop-source deletes the source once it is stored (the gathered
copy is checked against the digest taken before): a 16 GB run at R=2 then needs 48 GB of
disk at most instead of 64.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/worker_memory.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.local.cluster import LocalCluster  # noqa: E402
from coordinator.local.synthetic import write_checkpoint  # noqa: E402

GB = 1_000_000_000
MB = 1_000_000
SAMPLE_S = 0.05


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(x) for x in task.read_text().split()]
        except OSError:
            continue  # the thread ended meanwhile
    return kids


def _rss(pid: int) -> int:
    """VmRSS of a process in bytes, 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pss(pid: int) -> int:
    """Proportional set size in bytes (shared pages split among their sharers, so the sum
    over a forked pool counts each page once), 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree(pid: int) -> list[int]:
    """A process and all its descendants now (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def tree_rss(pid: int) -> tuple[int, int, dict[int, int]]:
    """(RSS sum, largest RSS, PSS of each process by pid) in bytes of a process and all its
    descendants now."""
    procs = tree(pid)
    sizes = [_rss(p) for p in procs]
    return sum(sizes), max(sizes, default=0), {p: _pss(p) for p in procs}


class Sampler:
    """Peak tree RSS of `pid` while the block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_sum, self.peak_one, self.peak_pss = pid, 0, 0, 0
        # Peak PSS of each process on its own (parent first, then the pool children by pid):
        # which one grows with the checkpoint size, not only the tree's sum.
        self.peak_by_pid: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total, largest, pss = tree_rss(self.pid)
            self.peak_sum, self.peak_one = max(self.peak_sum, total), max(self.peak_one, largest)
            self.peak_pss = max(self.peak_pss, sum(pss.values()))
            for p, size in pss.items():
                self.peak_by_pid[p] = max(self.peak_by_pid.get(p, 0), size)
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def cli(env: dict[str, str], *argv: str) -> tuple[float, dict]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=4 * 3600,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"smoltorrent {' '.join(argv)} failed: {done.stdout.strip()} {done.stderr.strip()}"
        )
    return time.perf_counter() - start, json.loads(done.stdout)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def measure(
    size_gb: float,
    nodes: int,
    root: Path,
    worker_env: dict[str, str] | None = None,
    drop_source: bool = False,
) -> dict:
    source = root / f"model-{size_gb:g}gb.safetensors"
    log(f"writing a {size_gb:g} GB checkpoint")
    size = write_checkpoint(source, int(size_gb * GB))
    past = time.time() - 60  # settled: the store does not wait for it
    os.utime(source, (past, past))
    digest = sha256_file(source)
    cluster = LocalCluster(root / "cluster", nodes=nodes, host_id=f"rss-{os.getpid()}")
    out = cluster.root / "gathered.safetensors"  # the worker gathers under its root only
    try:
        cluster.start(worker=False)
        cluster.start_worker(worker_env)
        env = cluster.env()
        cli(env, "nodes", "add", *(str(n.address) for n in cluster.node_procs))
        pid = cluster.worker.pid
        idle, _, idle_pss_by_pid = tree_rss(pid)
        idle_pss = sum(idle_pss_by_pid.values())
        row = {
            "size_bytes": size,
            "idle_tree_rss_mb": round(idle / MB, 1),
            "idle_tree_pss_mb": round(idle_pss / MB, 1),
            "nodes": nodes,
            "worker_env": worker_env or {},
        }
        for what, argv in (
            ("store", ("store", str(source), "--name", "rss")),
            ("gather", ("gather", "rss", "-o", str(out))),
        ):
            log(f"{what} {size_gb:g} GB")
            with Sampler(pid) as s:
                seconds, _ = cli(env, *argv)
            row[what] = {
                "seconds": round(seconds, 2),
                "peak_tree_rss_mb": round(s.peak_sum / MB, 1),
                "peak_process_rss_mb": round(s.peak_one / MB, 1),
                "peak_tree_pss_mb": round(s.peak_pss / MB, 1),
                "processes": len(tree(pid)),
                "peak_pss_mb_by_process": {
                    ("parent" if p == pid else f"child-{p}"): round(v / MB, 1)
                    for p, v in sorted(s.peak_by_pid.items(), key=lambda kv: kv[0] != pid)
                },
            }
            if what == "store" and drop_source:
                source.unlink()
        if sha256_file(out) != digest:
            raise RuntimeError("the gathered file differs from the source")
        return row
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
        for path in (source, out):
            path.unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker-env", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--drop-source", action="store_true")
    args = parser.parse_args()
    worker_env = dict(item.split("=", 1) for item in args.worker_env)
    root = Path(tempfile.mkdtemp(prefix="smoltorrent-rss-"))
    try:
        rows = [
            measure(size, args.nodes, root, worker_env, args.drop_source) for size in args.size_gb
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("size GB | op     | seconds | peak tree RSS MB | peak tree PSS MB | largest MB | procs")
    for row in rows:
        for what in ("store", "gather"):
            r = row[what]
            print(
                f"{row['size_bytes'] / GB:7.2f} | {what:6s} | {r['seconds']:7.1f} |"
                f" {r['peak_tree_rss_mb']:16.1f} | {r['peak_tree_pss_mb']:16.1f} |"
                f" {r['peak_process_rss_mb']:10.1f} | {r['processes']:5d}"
            )
        print(
            f"        idle worker tree before the store: RSS {row['idle_tree_rss_mb']:.1f} MB,"
            f" PSS {row['idle_tree_pss_mb']:.1f} MB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
