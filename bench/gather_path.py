"""Where a chunked gather's time goes, beside raw gathers of the same bytes.

    .venv/bin/python -m bench.gather_path --size-gb 1 --rounds 3 [--json]

Stores one synthetic checkpoint through a LocalCluster and the CLI (chunked, R=2), puts
the same bytes on raw nodes (bench/raw_reference.py) twice: as 4 ranges (what
bench.store_gather's raw gather moves) and as the chunks' own ranges (one connection per
chunk). Then, round after round, each in a fresh process:
  raw, raw_hashed              the 4 ranges (hashed: SHA-256 of what arrives)
  raw_chunks, raw_chunks_hashed  the chunk ranges
  engine   the gather engine alone (what run_gather does, imports outside the clock),
           with timers around the wire calls: thread-seconds waiting for each answer's
           header (the request's round trip), in the body (receive, hash, pwrite), in the
           pwrites; the machine's CPU (/proc/stat) over the engine; the final fsync
  cli      `smoltorrent gather NAME -o DIR/...` in its own process (outside every
           directory the worker writes: the CLI gathers itself), wall time
and once, one chunk read again and again over a kept connection (the smallest, the
median and the largest chunk): the fixed cost per request, one thread.
Each run holds nothing else; run it under `flock /tmp/st-cpu.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GB = 1_000_000_000


def _cpu() -> list[int]:
    """The machine's CPU counters (/proc/stat's first line), in clock ticks."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _cpu_split(before: list[int], after: list[int]) -> dict[str, float]:
    d = [b - a for a, b in zip(before, after, strict=True)]
    tick = os.sysconf("SC_CLK_TCK")
    names = {"user": 0, "sys": 2, "idle": 3, "iowait": 4, "softirq": 6}
    return {f"cpu_{name}_s": round(d[i] / tick, 2) for name, i in names.items()}


def _engine(name: str, out: str) -> dict:
    """Child: the gather engine alone, timed, with thread-seconds per wire call."""
    from coordinator.dataplane.bandwidth import WireMeter
    from coordinator.dataplane.gather_engine import gather_checkpoint
    from smoltorrent import durable
    from tasks.gathering import _sources
    from tasks.requests import metadata
    from worker_server import wire

    spent: dict[str, float] = {}
    lock = threading.Lock()

    def timed(module, attr: str, key: str) -> None:
        call = getattr(module, attr)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                with lock:
                    spent[key] = spent.get(key, 0.0) + time.perf_counter() - start

        setattr(module, attr, wrapper)

    timed(wire, "send_frame", "request_send_thread_s")
    timed(wire, "recv_response", "header_wait_thread_s")
    timed(wire, "recv_to_file", "body_thread_s")
    timed(wire, "_pwrite_all", "pwrite_thread_s")
    timed(durable, "sync", "fsync_s")
    md = metadata()
    vkey = md.versions.resolve(name)
    manifest = md.versions.manifest(vkey)
    sources = _sources(md, manifest, md.nodes.nodes(), WireMeter.limited(None))
    cpu = _cpu()
    start = time.perf_counter()
    gather_checkpoint(manifest, sources, out, progress=lambda n: None)
    seconds = time.perf_counter() - start
    sizes = [c.data_end - c.data_start for c in manifest.chunks]
    return {
        "seconds": round(seconds, 3),
        "chunks": len(sizes),
        "raw_chunks": sum(
            1 for c, n in zip(manifest.chunks, sizes, strict=True) if c.blob_size == n
        ),
        **{k: round(v, 3) for k, v in spent.items()},
        **_cpu_split(cpu, _cpu()),
    }


def _probe(name: str, out: str) -> dict:
    """Child: one chunk read again and again over one kept connection, one thread: the
    smallest, the median and the largest chunk of the version."""
    from coordinator.dataplane.bandwidth import WireMeter
    from coordinator.dataplane.node_client import KeptConnections
    from tasks.gathering import _sources
    from tasks.requests import metadata

    md = metadata()
    manifest = md.versions.manifest(md.versions.resolve(name))
    sources = _sources(md, manifest, md.nodes.nodes(), WireMeter.limited(None))
    by_size = sorted(manifest.chunks, key=lambda c: c.blob_size)
    picks = {"smallest": by_size[0], "median": by_size[len(by_size) // 2], "largest": by_size[-1]}
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    found = {}
    try:
        with KeptConnections() as kept:
            for label, chunk in picks.items():
                client = sources[chunk.index][0].keeping(kept)
                # about 64 MB per size, at least 20 reads
                count = max(20, min(500, 64_000_000 // max(chunk.blob_size, 1)))

                def read(n: int, client=client, chunk=chunk) -> None:
                    for _ in range(n):
                        client.get_blob_to_file(chunk.blob_sha256, fd, 0, size=chunk.blob_size)

                read(3)
                times = os.times()
                start = time.perf_counter()
                read(count)
                wall = time.perf_counter() - start
                after = os.times()
                cpu = after.user - times.user + after.system - times.system
                found[label] = {
                    "bytes": chunk.blob_size,
                    "requests": count,
                    "per_request_ms": round(wall / count * 1000, 3),
                    "client_cpu_per_request_ms": round(cpu / count * 1000, 3),
                    "mb_s": round(chunk.blob_size * count / wall / 1e6, 1),
                }
    finally:
        os.close(fd)
        os.unlink(out)
    return found


def _child(argv: list[str]) -> int:
    op, name, out = argv
    result = {"engine": _engine, "probe": _probe}[op](name, out)
    print(json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("engine", "probe"):
        return _child(argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench.gather_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="the JSON summary on stdout")
    parser.add_argument("--workdir", type=Path, help="parent of the scratch dir (default /tmp)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="smoltorrent-gather-path-", dir=args.workdir or "/tmp"))
    try:
        summary = _measure(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(summary, indent=2) if args.json else _table(summary))
    return 0


def _measure(args: argparse.Namespace, root: Path) -> dict:
    from bench.child import _raw_store
    from bench.store_gather import (
        ROOT,
        child_env,
        cli,
        log,
        run_child,
        sha256_file,
        start_raw_nodes,
        stop,
    )
    from coordinator.local.cluster import LocalCluster
    from coordinator.local.synthetic import write_checkpoint
    from coordinator.plan.manifest import Manifest

    source = root / "model.safetensors"
    log(f"building a {args.size_gb:g} GB synthetic checkpoint")
    size = write_checkpoint(source, int(args.size_gb * GB))
    digest = sha256_file(source)
    cluster = LocalCluster(root / "celery", nodes=args.nodes, host_id=f"gather-path-{os.getpid()}")
    raw: list = []
    timeout = 600 + 300 * size / GB
    try:
        log("starting a LocalCluster; store through the CLI")
        cluster.start(worker=True)
        env = child_env(cluster.env())
        cli(env, 60, "nodes", "add", *(str(n.address) for n in cluster.node_procs))
        cli(env, timeout, "store", str(source), "--replicas", str(args.replicas))
        manifest = Manifest.from_json(
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from tasks.requests import metadata; md = metadata();"
                    " v = md.versions.resolve(sys.argv[1]);"
                    " sys.stdout.write(md.versions.manifest(v).to_json().decode())",
                    source.name,
                ],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        start = manifest.data_start
        chunks = [(start + c.data_start, c.data_end - c.data_start) for c in manifest.chunks]
        data = manifest.source_size - start
        quarter = data // 4
        ranges = [(start + i * quarter, quarter if i < 3 else data - 3 * quarter) for i in range(4)]
        log("raw nodes: the data as 4 ranges, and as the chunks' ranges")
        raw = start_raw_nodes(root / "raw4", args.nodes) + start_raw_nodes(
            root / "rawc", args.nodes
        )
        ports4 = [port for _, port in raw[: args.nodes]]
        portsc = [port for _, port in raw[args.nodes :]]
        for pieces, ports in ((ranges, ports4), (chunks, portsc)):
            _raw_store(
                {
                    "source": str(source),
                    "ranges": pieces,
                    "targets": [[i % args.nodes] for i in range(len(pieces))],
                    "ports": ports,
                }
            )
        reader = root / "reader"
        reader.mkdir()
        out = reader / "gathered.safetensors"

        def raw_spec(pieces, ports, hashed: bool) -> dict:
            return {
                "op": "raw_gather",
                "source": str(source),
                "out": str(out),
                "size": size,
                "header_len": start,
                "ranges": pieces,
                "served_by": [i % args.nodes for i in range(len(pieces))],
                "ports": ports,
                "hashed": hashed,
            }

        def child(op: str) -> dict:
            started = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "bench.gather_path", op, source.name, str(out)],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=True,
            )
            return {"process_wall_s": round(time.perf_counter() - started, 3)} | json.loads(
                done.stdout.strip().splitlines()[-1]
            )

        modes = {
            "raw": lambda: run_child(raw_spec(ranges, ports4, False), root, timeout),
            "raw_hashed": lambda: run_child(raw_spec(ranges, ports4, True), root, timeout),
            "raw_chunks": lambda: run_child(raw_spec(chunks, portsc, False), root, timeout),
            "raw_chunks_hashed": lambda: run_child(raw_spec(chunks, portsc, True), root, timeout),
            "engine": lambda: child("engine"),
            "cli": lambda: {
                "process_wall_s": cli(env, timeout, "gather", source.name, "-o", str(out))[0]
            },
        }
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for round_ in range(args.rounds + 1):  # the first round fills the page cache: dropped
            for mode, run in modes.items():
                os.sync()
                result = run()
                if out.exists():
                    if sha256_file(out) != digest:
                        raise RuntimeError(f"{mode}: the gathered file is not the source")
                    out.unlink()
                if round_:
                    runs[mode].append(_flat(result))
                log(f"round {round_} {mode}: {_flat(result)}")
        os.sync()
        probe = child("probe")
    finally:
        stop([proc for proc, _ in raw])
        cluster.stop()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "code": _commit(ROOT),
        "command": "python -m bench.gather_path " + " ".join(sys.argv[1:]),
        "size_bytes": size,
        "chunks": len(chunks),
        "nodes": args.nodes,
        "replicas": args.replicas,
        "runs": runs,
        "medians": {mode: _medians(rows) for mode, rows in runs.items()},
        "per_request": probe,
    }


def _flat(result: dict) -> dict:
    """A child's figures: its seconds (the operation alone), its process's wall time, and
    the engine's or raw gather's own breakdown."""
    inner = result.get("result", {})
    flat = {k: v for k, v in result.items() if k not in ("result", "peak_rss_mb", "rss_before_mb")}
    flat |= {k: v for k, v in inner.items() if k.endswith("_s")}
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in flat.items()}


def _medians(rows: list[dict]) -> dict:
    keys = {k for row in rows for k, v in row.items() if isinstance(v, int | float)}
    return {k: sorted(row[k] for row in rows if k in row)[len(rows) // 2] for k in sorted(keys)}


def _commit(root: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def _table(summary: dict) -> str:
    lines = [f"{summary['date']} at {summary['code']}: {summary['chunks']} chunks, medians"]
    for mode, medians in summary["medians"].items():
        shown = ", ".join(f"{k} {v}" for k, v in medians.items())
        lines.append(f"  {mode}: {shown}")
    for label, figures in summary["per_request"].items():
        lines.append(f"  one {label} chunk per request: {figures}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
