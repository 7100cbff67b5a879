"""`ls` and `status` with many checkpoints in Redis: how long they take, and how many
requests they send.

    .venv/bin/python -m bench.scale_metadata [--versions 10000] [--names 100] [--repeat 5]

Records the versions straight through the metadata layer (made-up manifests of 2 shards,
both copies placed on two real node processes, every version committed), then times in
this process: the listing behind `ls` (reports.checkpoints), `ls NAME`, and `status`
(reports.status, which also probes the nodes); and, once each, the whole CLI command
(`smoltorrent ls --json`, `status --json`, and `ls` on a pseudo-terminal, where the table
is drawn) as a user runs it, interpreter start included.
Prints medians and the number of requests each sent to Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/scale_metadata.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.cli import reports  # noqa: E402
from coordinator.local.cluster import NodeProcess  # noqa: E402
from coordinator.local.synthetic import synthetic_manifest  # noqa: E402
from coordinator.plan.version_ids import storage_key  # noqa: E402
from coordinator.state.embedded_redis import start_redis, url_for  # noqa: E402
from coordinator.state.metadata import Metadata  # noqa: E402


def _record(md: Metadata, names: int, versions: int, node_ids: list[str]) -> None:
    per_name = versions // names
    for n in range(names):
        name = f"run{n:04d}/model.safetensors"
        for i in range(per_name):
            m = synthetic_manifest(name, i)
            vkey = storage_key(name, m.version_id)
            md.versions.create_pending(m, vkey, {}, [tuple(node_ids) for _ in m.shards])
            for s, shard in enumerate(m.shards):
                for r, node_id in enumerate(node_ids):
                    md.transfers.settle(vkey, s, r, node_id, shard.blob_sha256)
            md.versions.commit(vkey, name)


class CountedMetadata(Metadata):
    """Metadata on a new client that counts the requests it sends to Redis (a command or a
    whole pipeline each); the class is set before its first connection."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.sent = 0
        counter = self

        class Counting(self.r.connection_pool.connection_class):
            def send_packed_command(self, command, check_health=True):
                counter.sent += 1
                return super().send_packed_command(command, check_health)

        self.r.connection_pool.connection_class = Counting


def _on_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Seconds `argv` takes writing to a pseudo-terminal (as a user sees it: a table drawn
    for the terminal, not the plain rows a pipe gets), and how many lines it showed."""
    master, slave = pty.openpty()
    t = time.perf_counter()
    proc = subprocess.Popen(argv, env={**env, "COLUMNS": "150"}, stdout=slave, stderr=slave)
    os.close(slave)
    out = bytearray()
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        out += chunk
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {out[-2000:].decode(errors='replace')}")
    seconds = time.perf_counter() - t
    os.close(master)
    return seconds, out.count(b"\n")


def _time(fn, repeat: int) -> tuple[float, list[float]]:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs), runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=10_000)
    parser.add_argument("--names", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="smoltorrent-scale-"))
    pid, port = start_redis(root / "redis")
    nodes = [NodeProcess(root / f"node{i}", None).start() for i in range(2)]
    try:
        url = url_for(root / "redis", port)
        md = Metadata(url)
        ids = []
        for node in nodes:
            ids.append(node.client().stat().node_id)
            md.nodes.add_node(ids[-1], node.address)
        t = time.perf_counter()
        _record(md, args.names, args.versions, ids)
        print(
            f"recorded {args.versions} versions of {args.names} names in "
            f"{time.perf_counter() - t:.1f} s"
        )
        md = counter = CountedMetadata(url)
        one = "run0042/model.safetensors"
        results = {}
        for what, fn in (
            ("ls", lambda: reports.checkpoints(md)),
            ("ls NAME", lambda: reports.checkpoints(md, one)),
            ("status", lambda: reports.status(md, None)),
        ):
            counter.sent = 0
            rows = fn()
            requests = counter.sent
            median, runs = _time(fn, args.repeat)
            count = len(rows) if isinstance(rows, list) else len(rows["nodes"])
            results[what] = {"median_s": median, "runs_s": runs, "requests": requests}
            print(
                f"{what:8s} {median * 1000:7.1f} ms median of {args.repeat} "
                f"(min {min(runs) * 1000:.1f}, max {max(runs) * 1000:.1f}); "
                f"{requests} requests to Redis; {count} rows"
            )
        env = {**os.environ, "SMOLTORRENT_REDIS_URL": url, "SMOLTORRENT_HOME": str(root)}
        for argv in (["ls", "--json"], ["status", "--json"]):
            t = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-m", "coordinator.cli", *argv],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            seconds = time.perf_counter() - t
            shown = json.loads(out.stdout)
            print(
                f"smoltorrent {' '.join(argv)}: {seconds:.2f} s whole command "
                f"(interpreter start and imports included), "
                f"{len(shown) if isinstance(shown, list) else 'ok'}"
            )
        seconds, lines = _on_a_terminal([sys.executable, "-m", "coordinator.cli", "ls"], env)
        print(f"smoltorrent ls on a terminal: {seconds:.2f} s whole command, {lines} lines shown")
    finally:
        for node in nodes:
            node.stop()
        os.kill(pid, signal.SIGTERM)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
