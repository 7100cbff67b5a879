"""Could the store's plan-time SHA-256 hide behind its sends? Timed at engine level.

    .venv/bin/python -m bench.hash_overlap --size-gb 1 --repeat 3

One synthetic checkpoint, 4 node processes on loopback, R=2 by chain (the Celery path's
default), the shards' digests known from one untimed plan. Each run starts from nodes
that hold none of the blobs, and times:
  hash      the plan's hashing alone (HASH_THREADS threads over the shards)
  send      the chain sends alone (every shard at once, as the chain tasks run them)
  serial    hash, then send: what a store does today
  overlap   hash and send at once from the start (hashing beside sendfile)
  pipeline  each shard sent as soon as its own digest is known (HASH_THREADS threads)
with the share of the machine's CPU time that was busy during each (from /proc/stat).
Nothing here is the product's code path: it shows what reordering would be worth.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.store_gather import child_env  # noqa: E402
from coordinator.dataplane.chain_engine import Target, store_shard_chain  # noqa: E402
from coordinator.dataplane.store_engine import hash_shard, prepare_store  # noqa: E402
from coordinator.local.cluster import NodeProcess  # noqa: E402
from coordinator.local.synthetic import write_checkpoint  # noqa: E402
from coordinator.plan.chains import chain_order  # noqa: E402
from coordinator.plan.planner import plan_shards  # noqa: E402
from coordinator.plan.safetensors_header import read_header  # noqa: E402
from smoltorrent import defaults  # noqa: E402

MODES = ("hash", "send", "serial", "overlap", "pipeline")


def cpu_ticks() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the whole machine so far."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def measure(size_gb: float, repeat: int, root: Path) -> dict:
    source = root / "model.safetensors"
    write_checkpoint(source, int(size_gb * 1e9))
    nodes = [NodeProcess(root / f"node{i}", env=child_env()).start() for i in range(4)]
    try:
        ids = {n.client().ping(): n for n in nodes}
        prepared = prepare_store(str(source), "bench", dict.fromkeys(ids, 1 << 40), replicas=2)
        manifest = prepared.manifest
        header = read_header(str(source))
        plans = plan_shards(header, len(manifest.shards))
        chains = chain_order(list(prepared.targets), [s.blob_size for s in manifest.shards])

        def hash_one(index: int) -> int:
            hash_shard(str(source), header, plans[index])
            return index

        def send_one(index: int) -> None:
            targets = [Target(r, n, ids[n].client()) for r, n in enumerate(chains[index])]
            out = store_shard_chain(
                prepared.path,
                prepared.identity,
                prepared.spans()[index],
                targets,
            )
            if out.failed:
                raise RuntimeError(f"shard {index} was not placed: {out.failed}")

        shards = range(len(plans))

        def hash_all() -> None:
            with ThreadPoolExecutor(defaults.HASH_THREADS) as pool:
                list(pool.map(hash_one, shards))

        def send_all() -> None:
            with ThreadPoolExecutor(defaults.TRANSFER_THREADS) as pool:
                list(pool.map(send_one, shards))

        def pipeline() -> None:
            with (
                ThreadPoolExecutor(defaults.HASH_THREADS) as hashing,
                ThreadPoolExecutor(defaults.TRANSFER_THREADS) as sending,
            ):
                hashed = [hashing.submit(hash_one, i) for i in shards]
                sends = [sending.submit(send_one, f.result()) for f in as_completed(hashed)]
                for s in sends:
                    s.result()

        def overlap() -> None:
            beside = threading.Thread(target=hash_all)
            beside.start()
            send_all()
            beside.join()

        run = {
            "hash": hash_all,
            "send": send_all,
            "serial": lambda: (hash_all(), send_all()),
            "overlap": overlap,
            "pipeline": pipeline,
        }
        seconds: dict[str, list[float]] = {m: [] for m in MODES}
        busy: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(repeat):
            for mode in MODES:
                for node in nodes:  # every run sends to nodes that hold none of the blobs
                    for shard in manifest.shards:
                        node.client().delete(shard.blob_sha256)
                start_ticks, start = cpu_ticks(), time.perf_counter()
                run[mode]()
                seconds[mode].append(round(time.perf_counter() - start, 3))
                end_ticks = cpu_ticks()
                idle = (end_ticks[1] - start_ticks[1]) / max(1, end_ticks[0] - start_ticks[0])
                busy[mode].append(round(1 - idle, 2))
        return {
            mode: {
                "seconds": round(statistics.median(seconds[mode]), 3),
                "runs_s": seconds[mode],
                "cpu_busy": busy[mode],
            }
            for mode in MODES
        }
    finally:
        for node in nodes:
            node.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hash_overlap", description=__doc__)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="smoltorrent-overlap-"))
    try:
        result = measure(args.size_gb, args.repeat, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for mode, row in result.items():
        print(f"{mode:9} {row['seconds']:6.3f} s  runs {row['runs_s']}  cpu busy {row['cpu_busy']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
