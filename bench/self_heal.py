"""Self-healing figures on a local cluster: a flipped byte to two verified copies, and a
node's death to R copies on the survivors.

    .venv/bin/python -m bench.self_heal [--size-mb 1000] [--nodes 4] [--dead-after 5]
                                        [--interval 1] [--scrub-rate-mbps 10] [--json]
    .venv/bin/python -m bench.self_heal --death-only --dead-after 10 [--health-interval 2]

A LocalCluster (Redis, N node processes, a Celery worker, all on loopback) plus a real
`smoltorrent beat`, every sweep interval set to --interval seconds. With --death-only
only the death is timed, and every sweep keeps its default interval (the repair sweep's
30 s included) but the health probe (--health-interval) and the dead timeout: what a user
sees. The checkpoint is stored at R=2 through the CLI. Then, with nothing but beat running:
  flip   one byte of one copy on one node's disk is flipped; timed until that blob is
         whole on two nodes, counted twice in the placement, and nothing is quarantined.
         The node's scrub pass reaches the blob at --scrub-rate-mbps, so this depends on
         where the blob sits in the node's digest order: the figure says so.
  death  one node is SIGKILLed for good; timed until every blob has two copies on the
         survivors (placement and disks), with the moment the health sweep declared the
         node dead. The node killed is the one holding the most blobs. Then a second node
         is killed and the checkpoint gathered: its SHA-256 must match.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/self_heal.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pi_cluster import git_head  # noqa: E402
from coordinator.local.cluster import LocalCluster  # noqa: E402
from coordinator.local.synthetic import write_checkpoint  # noqa: E402
from coordinator.state.metadata import Metadata  # noqa: E402

POLL_S = 0.2  # seconds between looks at the cluster while timing


def log(msg: str) -> None:
    print(f"[self-heal] {msg}", file=sys.stderr, flush=True)


def cli(cluster: LocalCluster, *argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"smoltorrent {' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def blob_path(node, digest: str) -> Path:
    return node.data_dir / "blobs" / digest[:2] / digest


def on_disk(nodes) -> Counter:
    held: Counter = Counter()
    for n in nodes:
        held.update(list(n.client().list_blobs()))
    return held


def wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic() - start


def flip(args, cluster, md, by_id, sizes, digests, result: dict) -> None:
    """One byte of one copy flipped on a node's disk; timed until two verified copies."""
    digest = digests[0]
    victim_id = sorted(md.blobs.placement(digest))[0]
    victim = by_id[victim_id]
    held = sorted(victim.client().list_blobs().items())
    ahead = sum(sz for d, sz in held if d < digest)
    path = blob_path(victim, digest)
    with open(path, "r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 1]))
    log(f"flipped a byte of {digest[:12]} on {victim_id[:12]}")

    def healed() -> bool:
        whole = 0
        for n in cluster.node_procs:
            p = blob_path(n, digest)
            if p.exists() and sha256(p) == digest:
                whole += 1
        return (
            whole == 2
            and len(md.blobs.placement(digest)) == 2
            and not victim.client().scrub(start=False)["quarantined"]
        )

    result["flip_to_two_verified_copies_s"] = round(wait(healed, 3600, "the repair"), 1)
    result["flip_bytes_scrubbed_before_blob"] = ahead
    result["flip_blob_bytes"] = sizes[digest]
    log(f"flip -> 2 verified copies: {result['flip_to_two_verified_copies_s']} s")


def run(args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="self-heal-", dir=args.dir))
    interval = str(args.interval)
    env = {
        "SMOLTORRENT_HEALTH_INTERVAL_S": interval,
        "SMOLTORRENT_REPAIR_INTERVAL_S": interval,
        "SMOLTORRENT_SCRUB_INTERVAL_S": interval,
        "SMOLTORRENT_DEAD_AFTER_S": str(args.dead_after),
        "SMOLTORRENT_SCRUB_RATE_BPS": str(int(args.scrub_rate_mbps * 1e6)),
    }
    if args.death_only:
        env = {
            "SMOLTORRENT_HEALTH_INTERVAL_S": str(args.health_interval),
            "SMOLTORRENT_DEAD_AFTER_S": str(args.dead_after),
        }
    cluster = LocalCluster(root, nodes=args.nodes, host_id="bench", extra_env=env)
    beat = None
    try:
        cluster.start()
        cli(cluster, "nodes", "add", *(str(n.address) for n in cluster.node_procs))
        src = root / "ckpt.safetensors"
        size = write_checkpoint(src, args.size_mb * 1_000_000)
        past = time.time() - 60
        os.utime(src, (past, past))
        t = time.monotonic()
        cli(cluster, "store", str(src), "--name", "ckpt.safetensors")
        log(f"stored {size / 1e6:.0f} MB in {time.monotonic() - t:.1f} s")
        md = Metadata(cluster.redis_url)
        manifest = md.versions.manifest(md.versions.current("ckpt.safetensors"))
        sizes = {s.blob_sha256: s.blob_size for s in manifest.entries}
        digests = sorted(sizes)
        by_id = {n.client().ping(): n for n in cluster.node_procs}
        with open(root / "beat.log", "ab") as beat_log:
            beat = subprocess.Popen(
                [sys.executable, "-m", "coordinator.cli", "beat", "--loglevel", "INFO"],
                env=cluster.env(),
                stdout=beat_log,
                stderr=subprocess.STDOUT,
            )
        result: dict = {
            "code": git_head(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "env": env,
            "size_bytes": size,
            "nodes": args.nodes,
            "replicas": 2,
            "blobs": len(manifest.entries),
            "blob_bytes": {d[:12]: sz for d, sz in sizes.items()},
            "interval_s": None if args.death_only else args.interval,
            "dead_after_s": args.dead_after,
            "scrub_rate_bps": int(args.scrub_rate_mbps * 1e6),
        }

        if not args.death_only:
            flip(args, cluster, md, by_id, sizes, digests, result)

        # --- a node's death ------------------------------------------------------------
        # The node holding the most blobs: the worst single death.
        held_by = {i: [d for d in digests if i in md.blobs.placement(d)] for i in by_id}
        dead_id = max(sorted(held_by), key=lambda i: len(held_by[i]))
        dead, lost = by_id[dead_id], held_by[dead_id]
        survivors = [n for n in cluster.node_procs if n is not dead]
        ids = set(by_id) - {dead_id}
        # Killed once beat's health sweep has seen every node, as in a cluster that has run
        # a while: a node last seen at the store would be dead at once.
        wait(lambda: md.sweeps.sweep_runs("health"), 600, "a health sweep")
        dead.kill()
        killed = time.monotonic()
        runs_before = md.sweeps.sweep_runs("repair")
        log(f"killed {dead_id[:12]}, which held {len(lost)} of {len(digests)} blobs")
        declared = wait(lambda: dead_id in md.nodes.declared_dead(), 600, "the dead declaration")

        def at_r() -> bool:
            disk = on_disk(survivors)
            return all(len(md.blobs.placement(d) & ids) >= 2 and disk[d] >= 2 for d in digests)

        wait(at_r, 3600, "R copies on the survivors")
        total = time.monotonic() - killed
        result["death_declared_s"] = round(declared, 1)
        result["death_to_r_restored_s"] = round(total, 1)
        result["repair_after_declared_s"] = round(total - declared, 1)
        result["repaired_bytes"] = sum(sizes[d] for d in lost)
        result["repaired_blobs"] = len(lost)
        # Repair sweeps that ran between the kill and R restored: with copies started by
        # the copies before them, one (the first after the death) is all it takes.
        result["repair_sweeps_during_heal"] = len(md.sweeps.sweep_runs("repair")) - len(runs_before)
        log(f"death -> R on the survivors: {total:.1f} s (declared dead at {declared:.1f} s)")

        survivors[0].kill()
        out = root / "out.safetensors"
        cli(cluster, "gather", "ckpt.safetensors", "-o", str(out))
        result["gather_after_second_death_identical"] = sha256(out) == sha256(src)
        return result
    finally:
        if beat is not None:
            beat.terminate()
            beat.wait(timeout=30)
        cluster.stop()
        if not args.keep:
            subprocess.run(["rm", "-rf", str(root)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--dead-after", type=float, default=5.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--scrub-rate-mbps", type=float, default=10.0)
    parser.add_argument(
        "--death-only",
        action="store_true",
        help="time only a node's death, every sweep at its default interval",
    )
    parser.add_argument("--health-interval", type=float, default=2.0, help="with --death-only")
    parser.add_argument("--dir", default=None, help="where the cluster lives (default: tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the cluster's files")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else result)


if __name__ == "__main__":
    main()
