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
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/pi_cluster.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.local.synthetic import write_checkpoint  # noqa: E402
from coordinator.state.embedded_redis import redis_server_binary  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
PREFIX = f"stpi{os.getpid() % 10000}"  # namespace and link names; unique per run
SUBNET = "10.77.0"
COORD_IP = f"{SUBNET}.1"
NODE_PORT = 7411
REDIS_PORT = 6390
SAMPLE_S = 0.5  # per-port byte counters sampled this often, for bandwidth over time
ORIGINAL = {"store_s": 35.6, "gather_s": 17.8, "size_mib": 200, "rate_mbit": 100}


def log(msg: str) -> None:
    print(f"[pi-bench] {msg}", file=sys.stderr, flush=True)


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


class Network:
    """The namespaces, the bridge and the shaped veth pairs; removed by close()."""

    def __init__(self, hosts: list[str], rate_mbit: int) -> None:
        self.switch = f"{PREFIX}-sw"
        self.hosts = hosts
        self.rate_mbit = rate_mbit
        self.namespaces: list[str] = []

    def ns(self, host: str) -> str:
        return f"{PREFIX}-{host}"

    def port(self, host: str) -> str:
        return f"{PREFIX}{host}"[:15]  # the switch-side end of the host's link

    def open(self) -> Network:
        sh("ip", "netns", "add", self.switch)
        self.namespaces.append(self.switch)
        sw = ["ip", "netns", "exec", self.switch]
        sh(*sw, "ip", "link", "add", "br0", "type", "bridge")
        sh(*sw, "ip", "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            ns = self.ns(host)
            sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            port = self.port(host)
            sh("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", port, "netns", self.switch)
            sh(*sw, "ip", "link", "set", port, "master", "br0")
            sh(*sw, "ip", "link", "set", port, "up")
            inside = ["ip", "netns", "exec", ns]
            sh(*inside, "ip", "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
            sh(*inside, "ip", "link", "set", "eth0", "up")
            sh(*inside, "ip", "link", "set", "lo", "up")
            # Both directions of the link: the host's uplink and the switch port's downlink.
            self._shape(inside, "eth0")
            self._shape(sw, port)
        return self

    def _shape(self, prefix: list[str], dev: str) -> None:
        # burst: one 1 ms slice of the line rate, at least a few full frames.
        burst = max(self.rate_mbit * 1_000_000 // 8 // 1000, 8 * 1514)
        sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
           "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "50ms")  # fmt: skip

    def address(self, index: int) -> str:
        return COORD_IP if index == 0 else f"{SUBNET}.{10 + index}"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def cut(self, host: str) -> None:
        """Unplug: the switch port goes down, packets vanish, nobody gets a reset."""
        sh(*self.exec_prefix_switch(), "ip", "link", "set", self.port(host), "down")

    def reconnect(self, host: str) -> None:
        sh(*self.exec_prefix_switch(), "ip", "link", "set", self.port(host), "up")

    def exec_prefix_switch(self) -> list[str]:
        return ["ip", "netns", "exec", self.switch]

    def counters(self) -> dict[str, tuple[int, int]]:
        """Per host: (bytes the host sent, bytes it received), read on the switch side."""
        out = {}
        for host in self.hosts:
            port = self.port(host)
            read = sh(*self.exec_prefix_switch(), "cat",
                      f"/sys/class/net/{port}/statistics/rx_bytes",
                      f"/sys/class/net/{port}/statistics/tx_bytes").stdout.split()  # fmt: skip
            out[host] = (int(read[0]), int(read[1]))
        return out

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()


class Sampler(threading.Thread):
    """Per-host bytes per second over time, from the switch ports' counters."""

    def __init__(self, net: Network) -> None:
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


class Cluster:
    """Redis, the worker and the nodes, each a real process in its namespace."""

    def __init__(
        self, net: Network, root: Path, nodes: list[str], extra_env: dict[str, str]
    ) -> None:
        self.net = net
        self.root = root
        self.nodes = nodes
        self.procs: list[subprocess.Popen] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "SMOLTORRENT_HOME": str(root / "home"),
            "SMOLTORRENT_REDIS_URL": f"redis://127.0.0.1:{REDIS_PORT}/0",
            "SMOLTORRENT_CLUSTER_KEY": secrets.token_hex(32),
            "SMOLTORRENT_HOST_ID": "pi-bench-coordinator",
            # Gathers write only where allowed (safe defaults): the bench's own directory.
            "SMOLTORRENT_GATHER_DIRS": str(root),
            **extra_env,
        }

    def _spawn(self, host: str, argv: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.root / log_name, "ab")  # noqa: SIM115 (kept open for the child)
        proc = subprocess.Popen(
            [*self.net.exec_prefix(host), *argv], env=self.env, stdout=log, stderr=log
        )
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        redis_dir = self.root / "redis"
        redis_dir.mkdir(parents=True)
        self._spawn("coord", [redis_server_binary(), "--port", str(REDIS_PORT), "--bind",
                              "127.0.0.1", "--dir", str(redis_dir), "--appendonly", "yes",
                              "--save", ""], "redis.log")  # fmt: skip
        for index, node in enumerate(self.nodes, start=1):
            data = self.root / node
            self._spawn(node, [sys.executable, "-m", "worker_server", "--data-dir", str(data),
                               "--host", self.net.address(index), "--port", str(NODE_PORT)],
                        f"{node}.log")  # fmt: skip
        self._wait_redis()
        self._spawn("coord", [sys.executable, "-m", "coordinator.cli", "worker", "--loglevel",
                              "INFO"], "worker.log")  # fmt: skip
        deadline = time.monotonic() + 60
        worker_log = self.root / "worker.log"
        while b" ready." not in worker_log.read_bytes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start; see {worker_log}")
            time.sleep(0.2)
        while True:
            added = self.cli("nodes", "add",
                             *(f"{self.net.address(i)}:{NODE_PORT}"
                               for i in range(1, len(self.nodes) + 1)), check=False)  # fmt: skip
            if added.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes did not answer: {added.stderr}")
            time.sleep(0.5)

    def _wait_redis(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if b"Ready to accept connections" in (self.root / "redis.log").read_bytes():
                return
            time.sleep(0.1)
        raise RuntimeError("redis-server did not start in the coordinator namespace")

    def cli(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [*self.net.exec_prefix("coord"), sys.executable, "-m", "coordinator.cli", *argv],
            env=self.env,
            capture_output=True,
            text=True,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"smoltorrent {' '.join(argv)}: {proc.stderr or proc.stdout}")
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def timed_store(cluster: Cluster, source: Path, name: str, cut: tuple[str, float] | None) -> dict:
    timer = None
    if cut:
        timer = threading.Timer(cut[1], cluster.net.cut, args=(cut[0],))
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
    net = Network(["coord", *nodes], args.rate_mbit)
    extra_env = {}
    if args.socket_timeout is not None:
        extra_env["SMOLTORRENT_SOCKET_TIMEOUT_S"] = str(args.socket_timeout)
    if args.no_chain:
        extra_env["SMOLTORRENT_CHAIN"] = "0"
    cluster = Cluster(net, root, nodes, extra_env)
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
            identical = gathered.returncode == 0 and sh("cmp", str(source), str(out),
                                                         check=False).returncode == 0  # fmt: skip
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
