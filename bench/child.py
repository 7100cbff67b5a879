"""One measured operation in a fresh process: `python -m bench.child SPEC.json`.

Each store or gather runs alone in its own interpreter so that its peak RSS
(VmHWM, read here at the end) belongs to that operation and nothing else (no
bench bookkeeping, no node process). The time is taken around the operation
only; interpreter start-up and imports are outside it. One JSON line on stdout:
seconds, VmRSS before the operation and VmHWM after it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _store(spec: dict) -> dict:
    from coordinator.dataplane.node_client import NodeAddress
    from coordinator.dataplane.store_engine import store_checkpoint

    result = store_checkpoint(
        spec["source"],
        [NodeAddress.parse(a) for a in spec["addresses"]],
        replicas=spec["replicas"],
    )
    return {
        "manifest": result.manifest.to_json().decode(),
        "holders": result.holders,
        "errors": result.errors,
        "bytes_sent": result.bytes_sent,
    }


def _plan(spec: dict) -> dict:
    """Only the store's first phase (header, plan, hash every shard): no byte sent."""
    from coordinator.dataplane.store_engine import prepare_store

    free = {f"node{i}": 1 << 40 for i in range(spec["nodes"])}
    prepared = prepare_store(spec["source"], "bench", free, replicas=spec["replicas"])
    return {"shards": len(prepared.manifest.shards)}


def _gather(spec: dict) -> dict:
    from coordinator.dataplane.gather_engine import gather_checkpoint
    from coordinator.dataplane.node_client import NodeAddress, NodeClient
    from coordinator.plan.manifest import Manifest

    manifest = Manifest.from_json(Path(spec["manifest"]).read_text())
    sources = [[NodeClient(NodeAddress.parse(a)) for a in shard] for shard in spec["sources"]]
    report = gather_checkpoint(manifest, sources, spec["out"])
    return {"served_by": report.served_by, "fallbacks": report.fallbacks}


def _raw_store(spec: dict) -> dict:
    from bench.raw_reference import raw_store

    moved = raw_store(
        spec["source"],
        spec["ranges"],
        spec["targets"],
        spec["ports"],
        hashed=spec.get("hashed", False),
    )
    return {"bytes": moved}


def _raw_gather(spec: dict) -> dict:
    from bench.raw_reference import raw_gather

    return raw_gather(
        spec["source"],
        spec["out"],
        spec["size"],
        spec["header_len"],
        spec["ranges"],
        spec["served_by"],
        spec["ports"],
        hashed=spec.get("hashed", False),
    )


OPS = {
    "plan": _plan,
    "store": _store,
    "gather": _gather,
    "raw_store": _raw_store,
    "raw_gather": _raw_gather,
}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    op = OPS[spec["op"]]
    # Import everything before the clock and the RSS baseline start.
    import bench.raw_reference  # noqa: F401
    import coordinator.dataplane.gather_engine  # noqa: F401
    import coordinator.dataplane.store_engine  # noqa: F401

    rss_before = _status_kb("VmRSS")
    start = time.perf_counter()
    out = op(spec)
    seconds = time.perf_counter() - start
    Path(spec["result"]).write_text(json.dumps(out))
    print(
        json.dumps(
            {"seconds": seconds, "rss_before_kb": rss_before, "hwm_kb": _status_kb("VmHWM")}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
