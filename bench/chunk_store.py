"""Whole shards against chunks, at engine level on loopback: bytes stored, and a fine-tune.

    .venv/bin/python -m bench.chunk_store [--mib 200] [--celery]

An LLM-like checkpoint of about --mib MiB (coordinator/local/synthetic.py's layout,
hidden 1024: bf16 matrices of N(0, 0.02) values, fp32 norms of ones) is stored on 4 node
processes at R=2, each of the first two ways from nodes that hold nothing:
  shards   store_checkpoint (4 whole-shard blobs, raw), then gather_checkpoint
  chunks   store_chunked (coordinator/dataplane/chunk_engine.py), then gather_checkpoint
  raw      the same with encode=False: every chunk RAW, sent from the source (what a link
           faster than the encoder would use)
Then version 2 changes q_proj in every layer (about 8% of the bytes, spread over the
whole file) and each way stores it again on the nodes that hold version 1; the chunk
store is told version 1's chunks (raw digest -> blob). Printed per row: seconds, blob
bytes that moved (the engines' own counts, both replicas), that per replica as a share of
the checkpoint; every gather is checked byte-identical. One run; the node processes write
and fsync as in production. A bench, not a test: nothing is asserted.

With --celery, the same through what a user runs instead: a LocalCluster (Redis, 4 node
processes, a Celery worker) and `smoltorrent store` / `gather` as subprocesses, one
cluster per way: shards (SMOLTORRENT_CHUNKS=0), chunks encoded (SMOLTORRENT_CHUNKS=1,
SMOLTORRENT_ENCODE=zstd) and chunks auto (SMOLTORRENT_CHUNKS=1, the default encode policy:
RAW on loopback). Bytes moved are counted at the
nodes (smoltorrent_node_bytes_received_total); seconds are the CLI's wall clock, start-up
included.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/chunk_store.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402  (bench only: fills the checkpoint)
from ml_dtypes import bfloat16  # noqa: E402

from bench.store_gather import child_env, cli  # noqa: E402
from coordinator.dataplane.chunk_engine import store_chunked  # noqa: E402
from coordinator.dataplane.gather_engine import gather_checkpoint  # noqa: E402
from coordinator.dataplane.node_client import NodeClient  # noqa: E402
from coordinator.dataplane.store_engine import store_checkpoint  # noqa: E402
from coordinator.local.cluster import LocalCluster, NodeProcess  # noqa: E402
from coordinator.local.synthetic import llm_layout  # noqa: E402
from coordinator.plan.safetensors_header import read_header  # noqa: E402

MIB = 1 << 20
RECEIVED = "smoltorrent_node_bytes_received_total"


def write_model(path: Path, mib: int, changed_seed: int | None = None, seed: int = 0) -> list[str]:
    """Write the checkpoint (tensor i drawn from seed + i); with changed_seed, q_proj of every
    layer gets other values.
    Returns the names of the tensors that seed changes."""
    layout = llm_layout(mib * MIB)
    header, offset = {}, 0
    for name, dtype, shape in layout:
        size = (2 if dtype == "BF16" else 4) * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    changed = [n for n, _, _ in layout if n.endswith("self_attn.q_proj.weight")]
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for index, (name, dtype, shape) in enumerate(layout):
            count = int(np.prod(shape))
            if dtype == "F32":
                f.write(np.ones(count, np.float32).tobytes())
                continue
            drawn = seed + index
            drawn += changed_seed if changed_seed is not None and name in changed else 0
            values = np.random.default_rng(drawn).standard_normal(count, dtype=np.float32)
            f.write((values * 0.02).astype(bfloat16).tobytes())
    return changed


def sources(result, by_id, count):
    return [[by_id[n] for n in result.holders[i]] for i in range(count)]


CELERY_WAYS = {
    "shards": {"SMOLTORRENT_CHUNKS": "0"},
    # Chunks are the default; set all the same, so an environment's 0 does not leak in.
    "chunks": {"SMOLTORRENT_CHUNKS": "1", "SMOLTORRENT_ENCODE": "zstd"},
    "auto": {"SMOLTORRENT_CHUNKS": "1"},  # the encode policy's default: RAW on loopback
}


def received(cluster: LocalCluster) -> float:
    """Blob bytes every node has stored so far, from their /metrics."""
    total = 0.0
    for node in cluster.node_procs:
        port = (node.data_dir / "metrics_port").read_text().strip()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            text = page.read().decode()
        line = next(x for x in text.splitlines() if x.startswith(RECEIVED))
        total += float(line.split()[-1])
    return total


def celery_rows(root: Path, first: Path, second: Path, digest: dict, size: int) -> list[dict]:
    rows = []
    for way, extra in CELERY_WAYS.items():
        cluster = LocalCluster(
            root / f"celery-{way}",
            nodes=4,
            host_id=f"chunks-{way}-{os.getpid()}",
            extra_env={"SMOLTORRENT_METRICS_PORT": "0", **extra},
        )
        try:
            cluster.start(worker=True)
            env = child_env(cluster.env())
            cli(env, 60, "nodes", "add", *(str(n.address) for n in cluster.node_procs))
            for version, path in (("v1", first), ("v2 (q_proj changed)", second)):
                before = received(cluster)
                stored, out = cli(env, 600, "store", str(path), "--name", "ckpt")
                moved = received(cluster) - before
                dest = cluster.root / "gathered.safetensors"
                gathered, _ = cli(env, 600, "gather", "ckpt", "-o", str(dest))
                same = hashlib.sha256(dest.read_bytes()).hexdigest() == digest[path]
                dest.unlink()
                rows.append(
                    {
                        "way": f"cli {way}",
                        "version": version,
                        "blobs": out["shards"],
                        "store_s": round(stored, 2),
                        "gather_s": round(gathered, 2),
                        "bytes_moved": int(moved),
                        "per_replica_share": round(moved / 2 / size, 3),
                        "byte_identical": same,
                    }
                )
        finally:
            cluster.stop()
            shutil.rmtree(cluster.root, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument(
        "--celery", action="store_true", help="also through the CLI and a Celery worker"
    )
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="chunk-store-") as scratch:
        root = Path(scratch)
        first, second = root / "v1.safetensors", root / "v2.safetensors"
        write_model(first, args.mib)
        changed = write_model(second, args.mib, changed_seed=10_000)
        header = read_header(first)
        size = header.file_size
        changed_bytes = sum(t.size for t in header.tensors if t.name in changed)
        digest = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (first, second)}
        for way in ("shards", "chunks", "raw"):
            nodes = [
                NodeProcess(root / way / f"node{i}", env=child_env()).start() for i in range(4)
            ]
            try:
                addresses = [n.address for n in nodes]
                by_id = {NodeClient(a).ping(): NodeClient(a) for a in addresses}
                known: dict = {}
                for version, path in (("v1", first), ("v2 (q_proj changed)", second)):
                    start = time.perf_counter()
                    if way == "shards":
                        result = store_checkpoint(path, addresses, replicas=2)
                        count = len(result.manifest.shards)
                    else:
                        result = store_chunked(
                            path,
                            addresses,
                            root / "spool",
                            replicas=2,
                            known=known,
                            encode=way == "chunks",
                        )
                        count = len(result.manifest.chunks)
                        known = {
                            c.raw_sha256: (c.blob_sha256, c.blob_size)
                            for c in result.manifest.chunks
                        }
                    stored = time.perf_counter() - start
                    out = root / f"out-{way}-{path.name}"
                    start = time.perf_counter()
                    gather_checkpoint(result.manifest, sources(result, by_id, count), out)
                    gathered = time.perf_counter() - start
                    same = hashlib.sha256(out.read_bytes()).hexdigest() == digest[path]
                    out.unlink()
                    rows.append(
                        {
                            "way": way,
                            "version": version,
                            "blobs": count,
                            "store_s": round(stored, 2),
                            "gather_s": round(gathered, 2),
                            "bytes_moved": result.bytes_sent,
                            "per_replica_share": round(result.bytes_sent / 2 / size, 3),
                            "byte_identical": same,
                        }
                    )
            finally:
                for node in nodes:
                    node.stop()
                shutil.rmtree(root / way, ignore_errors=True)
        if args.celery:
            rows += celery_rows(root, first, second, digest, size)
    print(
        f"checkpoint {size / MIB:.1f} MiB, {len(changed)} q_proj changed in v2"
        f" ({changed_bytes / size:.1%} of the bytes); 4 nodes, R=2, loopback"
    )
    print(
        "way          | version             | blobs | store s | gather s | MB moved | per replica"
    )
    for r in rows:
        print(
            f"{r['way']:<13}| {r['version']:<20}| {r['blobs']:5} | {r['store_s']:7.2f} |"
            f" {r['gather_s']:8.2f} | {r['bytes_moved'] / 1e6:8.1f} |"
            f" {r['per_replica_share']:10.1%}{'' if r['byte_identical'] else '  NOT IDENTICAL'}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
