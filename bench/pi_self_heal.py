"""A node lost for good on the emulated Pi cluster: how long until its bytes are back at R.

    sudo .venv/bin/python -m bench.pi_self_heal [--size-mib 1000] [--nodes 4]
                                                [--rate-mbit 100] [--dead-after 10] [--json]

Needs root and iproute2. The emulation of bench/pi_cluster.py (every host a network
namespace, each wired to one switch by a link shaped to --rate-mbit both ways), with the
coordinator (Redis, the Celery worker, `smoltorrent beat`) in this process's own namespace
so the figures can be read straight from Redis. Every sweep keeps its default interval (the
repair sweep's 30 s included) but the health probe (--health-interval) and the dead timeout
(--dead-after): what a user sees.

An LLM-like checkpoint (bench/chunk_store.py) is stored at R=2. Once beat's health sweep
has seen every node, the node holding the most bytes is SIGKILLed and its port taken down
(a Pi gone for good). Timed until every blob has R copies on the survivors in the placement
(each copy recorded only after its target verified it), and the survivors' disks are then
counted too. The target (issue 37): back at R within 1.5x the time the survivors' links
need to carry the lost node's bytes (each byte leaves one survivor and enters another, so
the survivors' N-1 ports carry them at (N-1) x the rate), plus the dead timeout and one
repair interval. The survivors' port counters are sampled through the repair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/pi_self_heal.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pi_cluster import MIB, Sampler, git_head, log, tear_down, write_source  # noqa: E402
from bench.self_heal import wait  # noqa: E402
from coordinator.dataplane.node_client import NodeAddress, NodeClient  # noqa: E402
from coordinator.local.lan_cluster import LanCluster  # noqa: E402
from coordinator.local.netns import Lan  # noqa: E402
from coordinator.state.metadata import Metadata  # noqa: E402
from smoltorrent import defaults  # noqa: E402
from smoltorrent.defaults import SETTLED_MARGIN_S, STABLE_AFTER_S  # noqa: E402

PREFIX = f"stsh{os.getpid() % 10000}"  # namespace and link names; unique per run
TIMEOUT_S = 3600.0  # the longest this waits for any one phase


def run(args: argparse.Namespace) -> dict:
    nodes = [f"n{i}" for i in range(1, args.nodes + 1)]
    root = Path(tempfile.mkdtemp(prefix="smoltorrent-pi-heal-"))
    net = Lan(["coord", *nodes], prefix=PREFIX, rate_mbit=args.rate_mbit, local_host="coord")
    env = {
        "SMOLTORRENT_HEALTH_INTERVAL_S": str(args.health_interval),
        "SMOLTORRENT_DEAD_AFTER_S": str(args.dead_after),
    }
    cluster = LanCluster(net, root, nodes, env)
    try:
        net.open()
        cluster.start()
        source = root / "checkpoint.safetensors"
        write_source(source, args.size_mib * MIB, llm=True, run=0)
        settled = time.time() - STABLE_AFTER_S - SETTLED_MARGIN_S
        os.utime(source, (settled, settled))
        t = time.monotonic()
        cluster.cli("store", str(source), "--name", "ckpt.safetensors")
        log(f"stored {args.size_mib} MiB in {time.monotonic() - t:.1f} s")

        md = Metadata(cluster.env["SMOLTORRENT_REDIS_URL"])
        key = cluster.env["SMOLTORRENT_CLUSTER_KEY"].encode()
        ids = {str(r.address): node_id for node_id, r in md.nodes.nodes().items()}
        host_of = {ids[cluster.node_address(n)]: n for n in nodes}
        manifest = md.versions.manifest(md.versions.current("ckpt.safetensors"))
        sizes = {e.blob_sha256: e.blob_size for e in manifest.entries}
        held = {i: {d for d in sizes if i in md.blobs.placement(d)} for i in host_of}
        dead_id = max(sorted(held), key=lambda i: sum(sizes[d] for d in held[i]))
        dead = host_of[dead_id]
        survivors = [n for n in nodes if n != dead]
        alive_ids = set(host_of) - {dead_id}
        lost_bytes = sum(sizes[d] for d in held[dead_id])
        # Where each lost blob's other copy is: the only survivor that can send it.
        sources = {host_of[i]: sum(sizes[d] for d in held[dead_id] & held[i]) for i in sorted(held)}
        link_s = lost_bytes * 8 / (len(survivors) * args.rate_mbit * 1e6)
        repair_interval = defaults.REPAIR_INTERVAL_S
        target_s = 1.5 * link_s + args.dead_after + repair_interval

        cluster.start_beat()
        # Killed once beat's health sweep has seen every node, as in a cluster that has
        # run a while: a node last seen at the store would be dead at once.
        wait(lambda: md.sweeps.sweep_runs("health"), TIMEOUT_S, "a health sweep")
        sampler = Sampler(net)
        sampler.start()
        cluster.node_procs[dead].kill()
        net.cut(dead)
        killed = time.monotonic()
        log(f"killed {dead}: {len(held[dead_id])} of {len(sizes)} blobs, {lost_bytes / 1e6:.0f} MB")
        declared = wait(
            lambda: dead_id in md.nodes.declared_dead(), TIMEOUT_S, "the dead declaration"
        )
        log(f"{dead} declared dead at {declared:.1f} s")

        def at_r() -> bool:
            return all(len(md.blobs.placement(d) & alive_ids) >= 2 for d in sizes)

        wait(at_r, TIMEOUT_S, "R copies on the survivors")
        total = time.monotonic() - killed
        samples = sampler.stop()
        first_copy = next(
            (s["t"] for s in samples if any(s[n]["tx_mbit"] > 5 for n in survivors)), None
        )
        on_disk = {
            n: NodeClient(NodeAddress.parse(cluster.node_address(n)), cluster_key=key).list_blobs()
            for n in survivors
        }
        copies = {d: sum(d in on_disk[n] for n in survivors) for d in sizes}
        copying_s = total - first_copy if first_copy is not None else None
        result = {
            "code": git_head(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "size_mib": args.size_mib,
            "nodes": args.nodes,
            "rate_mbit": args.rate_mbit,
            "env": env,
            "repair_interval_s": repair_interval,
            "repair_bps": int(os.environ.get("SMOLTORRENT_REPAIR_BPS", defaults.REPAIR_BPS)),
            "blobs": len(sizes),
            "lost_blobs": len(held[dead_id]),
            "lost_bytes": lost_bytes,
            "lost_bytes_by_source": {n: b for n, b in sources.items() if n != dead},
            "survivors_link_s": round(link_s, 2),
            "target_s": round(target_s, 1),
            "declared_dead_s": round(declared, 1),
            "first_copy_bytes_s": first_copy,
            "back_at_r_s": round(total, 1),
            "copying_s": None if copying_s is None else round(copying_s, 1),
            "copying_x_link": None if copying_s is None else round(copying_s / link_s, 2),
            "within_target": total <= target_s,
            "every_blob_on_r_disks": all(c >= 2 for c in copies.values()),
            "survivor_bandwidth": [
                {"t": s["t"], **{n: round(s[n]["tx_mbit"], 1) for n in survivors}} for s in samples
            ],
        }
        log(
            f"back at R {total:.1f} s after the kill (declared dead {declared:.1f} s, bytes"
            f" flowing from {first_copy} s); target {target_s:.1f} s"
            f" (1.5 x {link_s:.1f} s + {args.dead_after:.0f} + {repair_interval:.0f})"
        )
        return result
    finally:
        tear_down(cluster, net, root, args.keep)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1000)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate-mbit", type=int, default=100)
    p.add_argument("--dead-after", type=float, default=10.0)
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--keep", action="store_true", help="keep the cluster's files")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else result)
    return 0 if result["within_target"] and result["every_blob_on_r_disks"] else 1


if __name__ == "__main__":
    sys.exit(main())
