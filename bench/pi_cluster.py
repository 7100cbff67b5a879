"""The emulated Pi cluster: a coordinator and N nodes behind 100 Mbit/s switch ports.

    sudo .venv/bin/python -m bench.pi_cluster [--size-mib 200] [--nodes 4] [--repeat 3]
                                              [--rate-mbit 100] [--cut-node-after 3] [--json]
                                              [--socket-timeout S] [--no-chain]
                                              [--llm] [--rsync]

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
ended: time, copies per shard, dead letters. A node whose host stops acknowledging
while bytes wait for it is given up after STALL_S (3 s) and its replicas move to the
others; a node silent otherwise waits out the socket timeout: --socket-timeout sets
SMOLTORRENT_SOCKET_TIMEOUT_S for the nodes and the worker (default 30 s).
--no-chain stores with SMOLTORRENT_CHAIN=0 (every copy from the coordinator).

--llm writes LLM-like values (bf16 weights N(0, 0.02), fp32 norms; bench/chunk_store.py)
instead of random bytes, which no encoding can shrink: the checkpoint whose figures the
issue's targets name. Each run gets other values (nothing is deduplicated across runs).

--rsync also times what a user would do instead, on the same emulation, once per run:
rsync to two nodes at once (an rsync daemon on each), the same with rsync's own zstd
compression (--compress-choice=zstd), and an rsync pull of one copy back.
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
from smoltorrent.defaults import SETTLED_MARGIN_S, STABLE_AFTER_S  # noqa: E402

MIB = 1 << 20
PREFIX = f"stpi{os.getpid() % 10000}"  # namespace and link names; unique per run
SAMPLE_S = 0.5  # per-port byte counters sampled this often, for bandwidth over time
FLOWING_MBIT = 5  # a port above this carries data, not just probes and acknowledgements
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
        last, last_t = self.net.counters(), time.monotonic()
        while not self.stop_event.wait(SAMPLE_S):
            # Rates over the time that really passed between reads: on a loaded machine a
            # read (a process in the switch namespace) can come late.
            now, now_t = self.net.counters(), time.monotonic()
            dt = now_t - last_t
            self.samples.append(
                {
                    "t": round(now_t - t0, 2),
                    **{
                        h: {
                            "tx_mbit": (now[h][0] - last[h][0]) * 8 / dt / 1e6,
                            "rx_mbit": (now[h][1] - last[h][1]) * 8 / dt / 1e6,
                        }
                        for h in now
                    },
                }
            )
            last, last_t = now, now_t

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
    return {
        "seconds": seconds,
        "exit": proc.returncode,
        "error": proc.stderr.strip()[-400:],
        "stdout": proc.stdout,
    }


def _json_or_none(text: str) -> dict | None:
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def blobs_per_node(cluster: LanCluster) -> dict[str, int]:
    """Blobs each node says it holds (status probes every node), by host name."""
    rows = json.loads(cluster.cli("status", "--json").stdout)["nodes"]
    by_address = {r["address"]: r["blobs"] or 0 for r in rows}
    return {n: by_address.get(cluster.node_address(n), 0) for n in cluster.nodes}


def served_counts(gather_json: str, cluster: LanCluster) -> dict[str, int]:
    """Shards each node served in a gather, from the gather's report."""
    try:
        served = json.loads(gather_json)["served_by"].values()
    except (ValueError, KeyError):
        return {}
    return {n: sum(a == cluster.node_address(n) for a in served) for n in cluster.nodes}


def flow(samples: list[dict], direction: str) -> list[float] | None:
    """[first, last] sample time (s) at which the coordinator's port moved data."""
    busy = [s["t"] for s in samples if s["coord"][direction] > FLOWING_MBIT]
    return [busy[0], busy[-1]] if busy else None


def port_bytes(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
) -> dict[str, dict[str, int]]:
    return {
        h: {"sent": after[h][0] - before[h][0], "received": after[h][1] - before[h][1]}
        for h in after
    }


RSYNC_PORT = 8730  # TCP; the rsync daemon each node runs for --rsync


def start_rsync_daemons(net: Lan, root: Path, nodes: list[str]) -> list[subprocess.Popen]:
    """An rsync daemon in each node's namespace, module `ckpt` writing under root."""
    procs = []
    for node in nodes:
        base = root / "rsync" / node
        (base / "data").mkdir(parents=True, exist_ok=True)
        conf = base / "rsyncd.conf"
        conf.write_text(
            f"pid file = {base / 'pid'}\nuse chroot = false\nuid = 0\ngid = 0\n"
            f"[ckpt]\npath = {base / 'data'}\nread only = false\n"
        )
        argv = ["rsync", "--daemon", "--no-detach", f"--config={conf}"]
        argv += [f"--address={net.address(node)}", f"--port={RSYNC_PORT}"]
        procs.append(subprocess.Popen([*net.exec_prefix(node), *argv]))
    time.sleep(1)  # the daemons bind
    return procs


def timed_rsync(net: Lan, source: Path, targets: list[str], name: str, zstd: bool) -> float:
    """Seconds to rsync `source` from the coordinator to every node of `targets` at once."""
    argv = ["rsync", "--whole-file"] + (["--compress", "--compress-choice=zstd"] if zstd else [])
    t = time.monotonic()
    procs = [
        subprocess.Popen(
            [
                *net.exec_prefix("coord"),
                *argv,
                str(source),
                f"rsync://{net.address(n)}:{RSYNC_PORT}/ckpt/{name}",
            ]  # fmt: skip
        )
        for n in targets
    ]
    if any(p.wait() != 0 for p in procs):
        raise RuntimeError("an rsync to a node failed")
    return time.monotonic() - t


def rsync_figures(net: Lan, root: Path, source: Path, nodes: list[str], i: int) -> dict:
    """rsync's store to two nodes (plain, then zstd) and pull of one copy back."""
    plain = timed_rsync(net, source, nodes[:2], f"run{i}.safetensors", zstd=False)
    zstd = timed_rsync(net, source, nodes[2:4] or nodes[:2], f"run{i}z.safetensors", zstd=True)
    back = root / f"rsync-pulled{i}.safetensors"
    t = time.monotonic()
    subprocess.run(
        [*net.exec_prefix("coord"), "rsync", "--whole-file",
         f"rsync://{net.address(nodes[0])}:{RSYNC_PORT}/ckpt/run{i}.safetensors", str(back)],
        check=True,
    )  # fmt: skip
    pull = time.monotonic() - t
    same = subprocess.run(["cmp", "-s", str(source), str(back)], check=False).returncode == 0
    back.unlink(missing_ok=True)
    for node in nodes:  # the next run stores new bytes under new names: room for them
        for f in (root / "rsync" / node / "data").glob("*"):
            f.unlink()
    return {
        "rsync_store_s": round(plain, 2),
        "rsync_zstd_store_s": round(zstd, 2),
        "rsync_pull_s": round(pull, 2),
        "rsync_pull_identical": same,
    }


def write_source(path: Path, size: int, llm: bool, run: int) -> None:
    if not llm:
        write_checkpoint(path, size)
        return
    from bench.chunk_store import write_model

    write_model(path, size // MIB, seed=1_000_000 * (run + 1))


def git_head() -> str:
    here = Path(__file__).resolve().parent
    head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--", "..",
                            ":!bench/results"], capture_output=True, text=True,
                           check=False).stdout.strip()  # fmt: skip
    return head + ("+uncommitted" if dirty else "")


def tear_down(cluster: LanCluster, net: Lan, root: Path, keep: bool) -> None:
    """Stop the cluster, remove the namespaces, and the files unless asked to keep them."""
    cluster.stop()
    net.close()
    if keep:
        log(f"files kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


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
    daemons: list[subprocess.Popen] = []
    try:
        net.open()
        log(f"network up: coordinator + {len(nodes)} nodes at {args.rate_mbit} Mbit/s per port")
        source = root / "checkpoint.safetensors"
        write_source(source, size, args.llm, 0)
        cluster.start()
        daemons += start_rsync_daemons(net, root, nodes) if args.rsync else []
        log(f"cluster up in {root}; line time {line_s:.1f} s for {args.size_mib} MiB")
        for i in range(args.repeat):
            # A fresh name and fresh values each run, so nothing is deduplicated.
            write_source(source, size, args.llm, i)
            # Written whole before the store starts, as a finished checkpoint is: dated back
            # past STABLE_AFTER_S, as the API does for its staged files, so the store does
            # not wait for a file just written to settle (1.3-2 s of every figure before).
            settled = time.time() - STABLE_AFTER_S - SETTLED_MARGIN_S
            os.utime(source, (settled, settled))
            load_before = os.getloadavg()
            blobs_before = blobs_per_node(cluster)
            ports = net.counters()
            sampler = Sampler(net)
            sampler.start()
            cut = (nodes[-1], args.cut_node_after) if args.cut_node_after is not None else None
            store = timed_store(cluster, source, f"bench/run{i}.safetensors", cut)
            store_samples = sampler.stop()
            store_ports, ports = port_bytes(ports, net.counters()), net.counters()
            blobs_after = blobs_per_node(cluster)
            out = root / f"gathered{i}.safetensors"
            t = time.monotonic()
            sampler = Sampler(net)
            sampler.start()
            gathered = cluster.cli(
                "gather", f"bench/run{i}.safetensors", "-o", str(out), "--json", check=False
            )
            gather_s = time.monotonic() - t
            gather_samples = sampler.stop()
            gather_ports = port_bytes(ports, net.counters())
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
                    "store_json": _json_or_none(store["stdout"]),
                    "gather_json_figures": {
                        k: v
                        for k, v in (_json_or_none(gathered.stdout) or {}).items()
                        if k in ("raw_bytes", "wire_bytes", "ratio", "seconds")
                    },
                    "gather_x_line": round(gather_s / line_s, 3),
                    "byte_identical": identical,
                    "gather_exit": gathered.returncode,
                    "gather_error": "" if gathered.returncode == 0 else gathered.stderr[-400:],
                    "load_before": [round(x, 2) for x in load_before],
                    "load_after": [round(x, 2) for x in os.getloadavg()],
                    # Balance: blobs this run put on each node (the nodes' own counts), the
                    # shards each node served in the gather, each port's bytes either way.
                    "blobs_added": {
                        n: blobs_after.get(n, 0) - blobs_before.get(n, 0) for n in blobs_after
                    },
                    "shards_served": served_counts(gathered.stdout, cluster),
                    "store_port_bytes": store_ports,
                    "gather_port_bytes": gather_ports,
                    "under_replicated": len(status.get("under_replicated", [])),
                    "dead_letters": status.get("dead_letters"),
                    # When the coordinator's port carried data: the start-up before the
                    # first byte is the part of the time the wire does not explain.
                    "store_bytes_flow_s": flow(store_samples, "tx_mbit"),
                    "gather_bytes_flow_s": flow(gather_samples, "rx_mbit"),
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
            if args.rsync:
                runs[-1].update(rsync_figures(net, root, source, nodes, i))
                log(
                    f"run {i}: rsync to 2 nodes {runs[-1]['rsync_store_s']} s, with zstd"
                    f" {runs[-1]['rsync_zstd_store_s']} s, pull {runs[-1]['rsync_pull_s']} s"
                )
    finally:
        for daemon in daemons:
            daemon.terminate()
        tear_down(cluster, net, root, args.keep)
    med = sorted(runs, key=lambda r: r["store_s"])[len(runs) // 2] if runs else {}
    return {
        "code": git_head(),
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
    """Wall time and aggregate throughput against the original system and the line, and
    per-port bandwidth over time for the first run's store and gather (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run0 = summary["runs"][0]
    mib, original = summary["size_mib"], summary["original"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ours = (summary["median_store_s"], summary["median_gather_s"])
    theirs = (original["store_s"], original["gather_s"])
    x = [0, 1]
    for ax, values, unit in (
        (axes[0][0], (ours, theirs), "seconds"),
        (axes[0][1], [[mib * MIB / 1e6 / v for v in vs] for vs in (ours, theirs)], "MB/s"),
    ):
        ax.bar([i - 0.2 for i in x], values[0], width=0.4, label="smoltorrent (median)")
        if mib == original["size_mib"]:  # its figures are for that size only
            ax.bar([i + 0.2 for i in x], values[1], width=0.4, label="original system")
        line = summary["line_s"] if unit == "seconds" else mib * MIB / 1e6 / summary["line_s"]
        ax.axhline(line, color="grey", linestyle="--", label="line (one copy, one port)")
        ax.set_xticks(x, ["store", "gather"])
        ax.set_ylabel(unit)
        ax.set_title(f"{'wall time' if unit == 'seconds' else 'aggregate throughput'}, "
                     f"{mib} MiB, R=2")  # fmt: skip
        ax.legend(fontsize=7)
    for ax, key, title in ((axes[1][0], "store_bandwidth", "store"), (axes[1][1],
                           "gather_bandwidth", "gather")):  # fmt: skip
        samples = run0[key]
        hosts = [h for h in samples[0] if h != "t"] if samples else []
        for host in hosts:
            direction = "tx_mbit" if (host == "coord") == (title == "store") else "rx_mbit"
            ax.plot([s["t"] for s in samples], [s[host][direction] for s in samples],
                    label=f"{host} {direction[:2]}")  # fmt: skip
        ax.set_title(f"{title} of {mib} MiB, run 1: {run0[title + '_s']} s, per port")
        ax.set_xlabel("seconds")
        ax.set_ylabel("Mbit/s")
        ax.legend(fontsize=7)
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
    p.add_argument("--llm", action="store_true", help="LLM-like values, not random bytes")
    p.add_argument("--rsync", action="store_true", help="time rsync beside it, once per run")
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
