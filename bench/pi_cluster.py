"""The emulated Pi cluster: a coordinator and N nodes behind 100 Mbit/s switch ports.

    sudo .venv/bin/python -m bench.pi_cluster [--size-mib 200] [--nodes 4] [--repeat 3]
                                              [--rate-mbit 100] [--cut-node-after 3] [--json]
                                              [--socket-timeout S] [--no-chain]

Needs root and iproute2. Every host is a network namespace of its own: the
coordinator (Redis, the Celery worker and the CLI) and each storage node. A
switch namespace holds a bridge; every host is wired to it by a veth pair
shaped with tbf on BOTH ends (full duplex: R Mbit/s up and R Mbit/s down per
port, as a Pi's Fast Ethernet behind a switch). The real CLI, worker and node
processes run inside. Everything made here is removed on exit, whatever
happens.

Line time = the bytes of one copy of the checkpoint through the coordinator's
port at the line rate. A store that sends every replica from the coordinator
needs R line times; a chain (node-to-node) store needs one. The original
system measured 35.6 s (store) and 17.8 s (gather) for 200 MiB at R=2 on this
emulation.

--cut-node-after S takes one node's switch port down S seconds into each
store (a Pi unplugged: packets vanish, no reset) and reports where the store
ended: time, copies per shard, dead letters. How soon the silent node is given
up (and its replicas moved to the others) is the socket timeout: --socket-timeout
sets SMOLTORRENT_SOCKET_TIMEOUT_S for the nodes and the worker (default 30 s).
--no-chain stores with SMOLTORRENT_CHAIN=0 (every copy from the coordinator).
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

if __package__ in (None, ""):  # run as `python bench/pi_cluster.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.local.lan_cluster import LanCluster  # noqa: E402
from coordinator.local.netns import Lan  # noqa: E402
from coordinator.local.synthetic import write_checkpoint  # noqa: E402

MIB = 1 << 20
PREFIX = f"stpi{os.getpid() % 10000}"  # namespace and link names; unique per run
SAMPLE_S = 0.5  # per-port byte counters sampled this often, for bandwidth over time
ORIGINAL = {"store_s": 35.6, "gather_s": 17.8, "size_mib": 200, "rate_mbit": 100}


def log(msg: str) -> None:
    print(f"[pi-bench] {msg}", file=sys.stderr, flush=True)


class Sampler(threading.Thread):
    """Per-host bytes per second over time, from the switch ports' counters."""

    def __init__(self, net: Lan) -> None:
        super().__init__(daemon=True)
        self.net = net
        self.samples: list[dict] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        last = self.net.counters()
        while not self.stop_event.wait(SAMPLE_S):
            now = self.net.counters()
            self.samples.append(
                {
                    "t": round(time.monotonic() - t0, 2),
                    **{
                        h: {
                            "tx_mbit": (now[h][0] - last[h][0]) * 8 / SAMPLE_S / 1e6,
                            "rx_mbit": (now[h][1] - last[h][1]) * 8 / SAMPLE_S / 1e6,
                        }
                        for h in now
                    },
                }
            )
            last = now

    def stop(self) -> list[dict]:
        self.stop_event.set()
        self.join()
        return self.samples


def timed_store(
    cluster: LanCluster, source: Path, name: str, cut: tuple[str, float] | None
) -> dict:
    timer = None
    if cut:
        timer = threading.Timer(cut[1], cluster.lan.cut, args=(cut[0],))
        timer.start()
    t = time.monotonic()
    proc = cluster.cli("store", str(source), "--name", name, "--json", check=False)
    seconds = time.monotonic() - t
    if timer:
        timer.cancel()
    return {"seconds": seconds, "exit": proc.returncode, "error": proc.stderr.strip()[-400:]}


def run(args: argparse.Namespace) -> dict:
    nodes = [f"n{i}" for i in range(1, args.nodes + 1)]
    root = Path(tempfile.mkdtemp(prefix="smoltorrent-pi-"))
    size = args.size_mib * MIB
    line_s = size * 8 / (args.rate_mbit * 1e6)
    net = Lan(["coord", *nodes], prefix=PREFIX, rate_mbit=args.rate_mbit)
    extra_env = {}
    if args.socket_timeout is not None:
        extra_env["SMOLTORRENT_SOCKET_TIMEOUT_S"] = str(args.socket_timeout)
    if args.no_chain:
        extra_env["SMOLTORRENT_CHAIN"] = "0"
    cluster = LanCluster(net, root, nodes, extra_env)
    runs: list[dict] = []
    try:
        net.open()
        log(f"network up: coordinator + {len(nodes)} nodes at {args.rate_mbit} Mbit/s per port")
        source = root / "checkpoint.safetensors"
        write_checkpoint(source, size)
        cluster.start()
        log(f"cluster up in {root}; line time {line_s:.1f} s for {args.size_mib} MiB")
        for i in range(args.repeat):
            # A fresh name and fresh random bytes each run, so nothing is deduplicated.
            write_checkpoint(source, size)
            sampler = Sampler(net)
            sampler.start()
            cut = (nodes[-1], args.cut_node_after) if args.cut_node_after is not None else None
            store = timed_store(cluster, source, f"bench/run{i}.safetensors", cut)
            store_samples = sampler.stop()
            out = root / f"gathered{i}.safetensors"
            t = time.monotonic()
            sampler = Sampler(net)
            sampler.start()
            gathered = cluster.cli(
                "gather", f"bench/run{i}.safetensors", "-o", str(out), "--json", check=False
            )
            gather_s = time.monotonic() - t
            gather_samples = sampler.stop()
            status = json.loads(cluster.cli("status", "--json").stdout)
            same = subprocess.run(["cmp", "-s", str(source), str(out)], check=False)
            identical = gathered.returncode == 0 and same.returncode == 0
            runs.append(
                {
                    "store_s": round(store["seconds"], 2),
                    "store_exit": store["exit"],
                    "store_error": store["error"],
                    "store_x_line": round(store["seconds"] / line_s, 3),
                    "gather_s": round(gather_s, 2),
                    "gather_x_line": round(gather_s / line_s, 3),
                    "byte_identical": identical,
                    "gather_exit": gathered.returncode,
                    "gather_error": (gathered.stderr.strip() or gathered.stdout.strip())[-400:],
                    "under_replicated": len(status.get("under_replicated", [])),
                    "dead_letters": status.get("dead_letters"),
                    "store_bandwidth": store_samples,
                    "gather_bandwidth": gather_samples,
                }
            )
            log(
                f"run {i}: store {store['seconds']:.1f} s ({store['seconds'] / line_s:.2f}x line)"
                f" exit {store['exit']}, gather {gather_s:.1f} s ({gather_s / line_s:.2f}x line),"
                f" identical {identical}, under-replicated {runs[-1]['under_replicated']},"
                f" dead letters {runs[-1]['dead_letters']}"
            )
            out.unlink(missing_ok=True)
            if cut:
                net.reconnect(cut[0])
    finally:
        cluster.stop()
        net.close()
        if args.keep:
            log(f"files kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    med = sorted(runs, key=lambda r: r["store_s"])[len(runs) // 2] if runs else {}
    return {
        "size_mib": args.size_mib,
        "nodes": args.nodes,
        "rate_mbit": args.rate_mbit,
        "line_s": round(line_s, 2),
        "cut_node_after_s": args.cut_node_after,
        "socket_timeout_s": args.socket_timeout,
        "chain": not args.no_chain,
        "median_store_s": med.get("store_s"),
        "median_gather_s": sorted(r["gather_s"] for r in runs)[len(runs) // 2] if runs else None,
        "original": ORIGINAL,
        "runs": runs,
    }


def plot(summary: dict, path: Path) -> None:
    """Per-node bandwidth over time for the first run's store and gather (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run0 = summary["runs"][0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, key, title in ((axes[0], "store_bandwidth", "store"), (axes[1], "gather_bandwidth",
                                                                   "gather")):  # fmt: skip
        samples = run0[key]
        hosts = [h for h in samples[0] if h != "t"] if samples else []
        for host in hosts:
            direction = "tx_mbit" if (host == "coord") == (title == "store") else "rx_mbit"
            ax.plot([s["t"] for s in samples], [s[host][direction] for s in samples],
                    label=f"{host} {direction[:2]}")  # fmt: skip
        ax.set_title(f"{title} of {summary['size_mib']} MiB, {run0[title + '_s']} s")
        ax.set_xlabel("seconds")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("Mbit/s per port")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=200)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rate-mbit", type=int, default=100)
    p.add_argument("--cut-node-after", type=float, help="unplug the last node S s into a store")
    p.add_argument("--socket-timeout", type=float, help="seconds before a silent node is given up")
    p.add_argument("--no-chain", action="store_true", help="send every copy from the coordinator")
    p.add_argument("--plot", type=Path, help="write a PNG of per-node bandwidth (matplotlib)")
    p.add_argument("--keep", action="store_true", help="keep the cluster's files")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if os.geteuid() != 0 or not shutil.which("tc"):
        print("bench.pi_cluster needs root and iproute2 (ip, tc).", file=sys.stderr)
        return 2
    summary = run(args)
    if args.plot:
        plot(summary, args.plot)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{summary['size_mib']} MiB, R=2, {summary['nodes']} nodes at "
            f"{summary['rate_mbit']} Mbit/s: line time {summary['line_s']} s; store "
            f"{summary['median_store_s']} s, gather {summary['median_gather_s']} s (medians); "
            f"original system: store {ORIGINAL['store_s']} s, gather {ORIGINAL['gather_s']} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
