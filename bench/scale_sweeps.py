"""Every sweep that walks blobs or versions, timed at 100k blobs and 10k versions, and
the longest time each holds Redis.

    .venv/bin/python -m bench.scale_sweeps [--versions 10000] [--blobs 100000]
        [--names 100] [--chunks 100] [--nodes 4] [--out bench/results/X.json]

Versions are chunked as a store makes them today (schema 3 manifests of `--chunks`
chunks each) and each name's versions are a fine-tune's chain: every version replaces
a few chunks of the one before it and shares the rest, so `--names` chains reach
`--blobs` distinct blobs over `--versions` versions. They are recorded straight through
the metadata layer (create and commit scripts, as a store's), each blob placed on 2 of
the real node processes, whose data directories are planted beforehand in the node's
own layout (blobs/<2 hex>/<digest>, manifests/<key>.json, every manifest on every node
holding one of its blobs, as a commit writes them). Each sweep's pass then runs in this
process as the worker runs it: the crosscheck, the scrub reports' settle, the repair
sweep's plan (nothing to copy: every blob at R) and one trim mark on the most shared
blob, `verify`, `ls` and `status`, and last a rebuild into an emptied Redis.

For each: seconds, and how long Redis was held: the longest single command Redis itself
timed (SLOWLOG, every command over 100 µs kept) and the longest a PING from another
process waited meanwhile (a probe pinging every 2 ms: what a store or a gather waiting
on Redis would see, MULTI blocks included, which SLOWLOG counts command by command).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/scale_sweeps.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.local.cluster import NodeProcess  # noqa: E402
from coordinator.plan.manifest import Manifest  # noqa: E402
from coordinator.plan.manifest_entries import ChunkEntry  # noqa: E402
from coordinator.plan.version_ids import chunked_version_id  # noqa: E402
from coordinator.state import redis_keys as K  # noqa: E402
from coordinator.state.embedded_redis import start_redis, url_for  # noqa: E402
from coordinator.state.metadata import Metadata  # noqa: E402

RAW_CHUNK = 4 << 20  # bytes a chunk covers in the (made-up) source: a store's target size
SLOWLOG_OVER_US = 100  # SLOWLOG keeps commands slower than this
SLOWLOG_KEEP = 100_000  # entries: a sweep's slow commands all fit
PROBE_EVERY_S = 0.002


def _blob(gid: int) -> tuple[bytes, str]:
    data = b"smoltorrent scale bench blob %d" % gid
    return data, hashlib.sha256(data).hexdigest()


def _raw(gid: int) -> str:
    return hashlib.sha256(b"raw %d" % gid).hexdigest()


def _header(chunks: int) -> bytes:
    layout = {
        f"model.layers.{k}.weight": {
            "dtype": "U8",
            "shape": [RAW_CHUNK],
            "data_offsets": [k * RAW_CHUNK, (k + 1) * RAW_CHUNK],
        }
        for k in range(chunks)
    }
    raw = json.dumps(layout, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def chains(names: int, per_name: int, chunks: int, blobs: int):
    """(name, index, [blob gid per chunk]) of every version: each name's first version has
    `chunks` new blobs, each next one replaces `change` of its predecessor's (spread over
    all chunks but the first, which stays as a frozen embedding does), so the whole reaches
    about `blobs` distinct blobs."""
    change = max(1, round((blobs / names - chunks) / max(per_name - 1, 1)))
    gid = 0
    for n in range(names):
        current = list(range(gid, gid + chunks))
        gid += chunks
        for i in range(per_name):
            if i:
                for k in range(change):
                    spot = (i * 7919 + k * max((chunks - 1) // change, 1)) % (chunks - 1)
                    current[1 + spot] = gid
                    gid += 1
            yield f"run{n:04d}/model.safetensors", i, list(current)


def manifest_of(name: str, index: int, gids: list[int], header: bytes) -> Manifest:
    entries = []
    for k, gid in enumerate(gids):
        data, digest = _blob(gid)
        entries.append(
            ChunkEntry(k, k * RAW_CHUNK, (k + 1) * RAW_CHUNK, _raw(gid), len(data), digest)
        )
    return Manifest(
        name=name,
        version_id=chunked_version_id(header, [_raw(g) for g in gids]),
        source_size=8 + len(header) + len(gids) * RAW_CHUNK,
        header_bytes=header,
        replicas=2,
        shards=(),
        created_at=1_700_000_000.0 + index,
        schema_version=3,
        chunks=tuple(entries),
    )


def holders(gid: int, nodes: int) -> tuple[int, int]:
    return gid % nodes, (gid + 1) % nodes


def plant_and_record(md: Metadata, dirs: list[Path], node_ids: list[str], args) -> dict:
    """Write every blob and manifest into the nodes' data directories, and record every
    version in Redis (committed, each blob placed on its two holders)."""
    per_name = args.versions // args.names
    header = _header(args.chunks)
    seen: set[int] = set()
    shared: set[int] | None = None  # blobs every version of the first name uses
    t = time.perf_counter()
    for count, (name, index, gids) in enumerate(
        chains(args.names, per_name, args.chunks, args.blobs)
    ):
        manifest = manifest_of(name, index, gids, header)
        if count < per_name:
            shared = set(gids) if shared is None else shared & set(gids)
        vkey = manifest.storage_key()
        new = [g for g in dict.fromkeys(gids) if g not in seen]
        seen.update(new)
        for gid in new:
            data, digest = _blob(gid)
            for n in holders(gid, len(dirs)):
                (dirs[n] / "blobs" / digest[:2] / digest).write_bytes(data)
        raw = manifest.to_json()
        on = {n for g in gids for n in holders(g, len(dirs))}
        for n in on:
            (dirs[n] / "manifests" / f"{vkey}.json").write_bytes(raw)
        md.versions.create_pending(manifest, vkey, {}, [])
        md.versions.commit(vkey, name)
        with md.r.pipeline(transaction=False) as p:
            for gid in new:
                digest = _blob(gid)[1]
                for n in holders(gid, len(dirs)):
                    p.sadd(K.PLACEMENT.format(digest=digest), node_ids[n])
            p.execute()
        if count % 1000 == 999:
            print(f"  {count + 1} versions, {len(seen)} blobs, {time.perf_counter() - t:.0f} s")
    return {
        "versions": count + 1,
        "blobs": len(seen),
        "record_s": time.perf_counter() - t,
        "most_shared": min(shared),
    }


PROBE = r"""
import select, sys, time, redis
r = redis.Redis.from_url(sys.argv[1]); worst = 0.0; slow = 0; pings = 0
while True:
    ready, _, _ = select.select([sys.stdin], [], [], float(sys.argv[2]))
    if ready:
        line = sys.stdin.readline()
        if not line: break
        print(f"{worst} {slow} {pings}", flush=True); worst = 0.0; slow = 0; pings = 0
        continue
    t = time.perf_counter(); r.ping(); took = time.perf_counter() - t
    worst = max(worst, took); slow += took > 0.05; pings += 1
"""


def _word(command: bytes | str) -> str:
    command = command.decode(errors="replace") if isinstance(command, bytes) else command
    return command.split(" ", 1)[0].upper()


class Held:
    """How long Redis is held while a sweep runs: SLOWLOG's longest command, and the
    longest PING wait the probe process saw."""

    def __init__(self, url: str, r) -> None:
        self.r = r
        self.probe = subprocess.Popen(
            [sys.executable, "-c", PROBE, url, str(PROBE_EVERY_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        r.config_set("slowlog-log-slower-than", SLOWLOG_OVER_US)
        r.config_set("slowlog-max-len", SLOWLOG_KEEP)

    def _probe(self) -> tuple[float, int, int]:
        self.probe.stdin.write("x\n")
        self.probe.stdin.flush()
        ready, _, _ = select.select([self.probe.stdout], [], [], 30)
        worst, slow, pings = self.probe.stdout.readline().split()
        return float(worst), int(slow), int(pings)

    def start(self) -> None:
        self.r.slowlog_reset()
        self._probe()

    def read(self) -> dict:
        worst, slow, pings = self._probe()
        log = self.r.slowlog_get(SLOWLOG_KEEP)
        # Not the probe's PINGs, nor the bench's own SLOWLOG and SCRIPT LOAD calls.
        ours = {"PING", "SLOWLOG", "SCRIPT", "CONFIG"}
        log = [e for e in log if _word(e["command"]) not in ours]
        top = max(log, key=lambda e: e["duration"], default=None)
        command = None
        if top is not None:
            command = top["command"]
            command = command.decode(errors="replace") if isinstance(command, bytes) else command
        return {
            "longest_command_ms": top["duration"] / 1000 if top else 0.0,
            "longest_command": (command or "")[:120],
            "commands_over_1ms": sum(e["duration"] > 1000 for e in log),
            "commands_over_10ms": sum(e["duration"] > 10_000 for e in log),
            "commands_over_100us": len(log),
            "ping_worst_ms": worst * 1000,
            "pings_over_50ms": slow,
            "pings": pings,
        }

    def close(self) -> None:
        self.probe.stdin.close()
        self.probe.wait(10)


def measure(held: Held, what: str, fn, results: dict) -> object:
    held.start()
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    figures = {"seconds": seconds, **held.read()}
    results[what] = figures
    print(
        f"{what:24s} {seconds:8.2f} s; longest command {figures['longest_command_ms']:7.1f} ms"
        f" ({figures['longest_command'][:40]}), {figures['commands_over_10ms']} over 10 ms;"
        f" worst ping {figures['ping_worst_ms']:7.1f} ms",
        flush=True,
    )
    return out


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=10_000)
    parser.add_argument("--blobs", type=int, default=100_000)
    parser.add_argument("--names", type=int, default=100)
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--skip", default="", help="comma-separated sweeps not to run")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    root = Path(tempfile.mkdtemp(prefix="smoltorrent-scale-sweeps-"))
    pid, port = start_redis(root / "redis")
    url = url_for(root / "redis", port)
    # What the sweeps' own metadata() and node clients read, in this process.
    os.environ.update(SMOLTORRENT_REDIS_URL=url, SMOLTORRENT_HOME=str(root / "home"))
    os.environ.pop("SMOLTORRENT_CLUSTER_KEY", None)
    dirs = [root / f"node{i}" for i in range(args.nodes)]
    nodes: list[NodeProcess] = []
    held = None
    try:
        node_ids = []
        for d in dirs:  # the layout a node makes at its first start, without a process
            (d / "manifests").mkdir(parents=True)
            for b in range(256):
                (d / "blobs" / f"{b:02x}").mkdir(parents=True)
            node_ids.append(os.urandom(16).hex())
            (d / "node_id").write_text(node_ids[-1] + "\n")
        md = Metadata(url)
        print(f"planting and recording {args.versions} versions ...", flush=True)
        setup = plant_and_record(md, dirs, node_ids, args)
        print(f"recorded: {setup}", flush=True)
        nodes = [NodeProcess(d, None).start() for d in dirs]
        for node_id, node in zip(node_ids, nodes, strict=True):
            md.nodes.add_node(node_id, node.address)
        from coordinator.cli import reports
        from coordinator.state.liveness import probe_registered

        probe_registered(md, None)
        held = Held(url, md.r)
        results: dict = {}
        run = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": _commit(),
            "args": {k: v for k, v in vars(args).items() if k != "out"} | {"out": None},
            "setup": setup,
            "redis_used_memory_mb": md.r.info("memory")["used_memory"] / 1e6,
            "sweeps": results,
        }
        if "ls" not in skip:
            measure(held, "ls (first)", lambda: reports.checkpoints(md), results)
            measure(held, "ls", lambda: reports.checkpoints(md), results)
            measure(held, "status", lambda: reports.status(md, None), results)
        if "crosscheck" not in skip:
            from beat import crosscheck

            out = measure(held, "crosscheck", lambda: crosscheck.run_pass(3600.0), results)
            results["crosscheck"]["result"] = out
        if "scrub" not in skip:
            from beat import scrub

            out = measure(held, "scrub", lambda: scrub.run_pass(start=False), results)
            results["scrub"]["result"] = out
        if "repair" not in skip:
            from beat import repair

            out = measure(held, "repair (first)", repair.run_pass, results)
            results["repair (first)"]["result"] = out
            out = measure(held, "repair", repair.run_pass, results)
            results["repair"]["result"] = out
        if "trim" not in skip:
            from coordinator.state import trim_marks

            # The most shared blob (the first chunk of run0000 that no version replaces:
            # used by all of that name's versions), with a surplus third copy to trim.
            gid = setup["most_shared"]
            digest = _blob(gid)[1]
            extra = next(n for n in range(args.nodes) if n not in holders(gid, args.nodes))
            nodes[holders(gid, args.nodes)[0]].client().replicate(digest, nodes[extra].address)
            md.blobs.add_placement(digest, node_ids[extra])
            users = len(md.blobs.blob_refs(digest))
            out = measure(
                held,
                "trim mark",
                lambda: trim_marks.mark(md, digest, node_ids[extra], 2, node_ids),
                results,
            )
            results["trim mark"]["result"] = {"marked": out, "versions_using": users}
            trim_marks.clear(md, digest, node_ids[extra])
        if "verify" not in skip:
            from coordinator.state.verify import verify_now

            out = measure(
                held,
                "verify",
                lambda: verify_now(md, None, dead_after=60.0, per_node=2),
                results,
            )
            results["verify"]["result"] = {
                k: v if isinstance(v, int) else len(v) for k, v in out.items() if k != "name"
            }
        if "rebuild" not in skip:
            from coordinator.state.rebuild import rebuild_metadata

            md.r.flushall()
            md = Metadata(url)
            addresses = [n.address for n in nodes]
            out = measure(held, "rebuild", lambda: rebuild_metadata(md, addresses, None), results)
            results["rebuild"]["result"] = {
                k: v if isinstance(v, int) else len(v) for k, v in out.items()
            }
            measure(held, "ls (after rebuild)", lambda: reports.checkpoints(md), results)
        run["redis_used_memory_mb_end"] = md.r.info("memory")["used_memory"] / 1e6
        if args.out:
            args.out.write_text(json.dumps(run, indent=1) + "\n")
            print(f"wrote {args.out}")
    finally:
        if held is not None:
            held.close()
        for node in nodes:
            node.stop()
        os.kill(pid, signal.SIGTERM)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
