"""Whole shards against chunks, at engine level on loopback: bytes stored, and a fine-tune.

    .venv/bin/python -m bench.chunk_store [--mib 200]

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
the checkpoint; every gather is checked byte-identical. One run, no Celery; the node
processes write and fsync as in production. A bench, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/chunk_store.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402  (bench only: fills the checkpoint)
from ml_dtypes import bfloat16  # noqa: E402

from bench.store_gather import child_env  # noqa: E402
from coordinator.dataplane.chunk_engine import store_chunked  # noqa: E402
from coordinator.dataplane.gather_engine import gather_checkpoint  # noqa: E402
from coordinator.dataplane.node_client import NodeClient  # noqa: E402
from coordinator.dataplane.store_engine import store_checkpoint  # noqa: E402
from coordinator.local.cluster import NodeProcess  # noqa: E402
from coordinator.local.synthetic import llm_layout  # noqa: E402
from coordinator.plan.safetensors_header import read_header  # noqa: E402

MIB = 1 << 20


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--json", help="write the rows here too")
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
    print(
        f"checkpoint {size / MIB:.1f} MiB, {len(changed)} q_proj changed in v2"
        f" ({changed_bytes / size:.1%} of the bytes); 4 nodes, R=2, loopback"
    )
    print("way    | version             | blobs | store s | gather s | MB moved | per replica")
    for r in rows:
        print(
            f"{r['way']:<7}| {r['version']:<20}| {r['blobs']:5} | {r['store_s']:7.2f} |"
            f" {r['gather_s']:8.2f} | {r['bytes_moved'] / 1e6:8.1f} |"
            f" {r['per_replica_share']:10.1%}{'' if r['byte_identical'] else '  NOT IDENTICAL'}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
