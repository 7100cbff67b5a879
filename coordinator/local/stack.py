"""`smoltorrent up`: a whole stack on this machine in the foreground, until SIGTERM or Ctrl-C.

Redis (the embedded one, if no SMOLTORRENT_REDIS_URL), local storage nodes (registered
by id), the worker, beat, and optionally a watcher and Flower; each is the same command a
user runs by hand, as a child process in a session of its own, its output in a log file.
A stop signal, or any part dying on its own, stops them all in reverse order: each part
gets SIGTERM and its grace period (a worker finishes its transfers, a node its requests),
then SIGKILL to its whole process group; a Redis that `up` started is stopped last (its
AOF keeps the data). Nothing is left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coordinator import config
from coordinator.dataplane.node_client import NodeAddress, NodeClient, NodeStat
from coordinator.state.embedded_redis import ensure_redis_url, redis_status, stop_redis
from coordinator.state.metadata import Metadata
from coordinator.state.nodes import local_node
from smoltorrent import defaults
from smoltorrent.cluster_key import key_from_env
from smoltorrent.errors import SmoltorrentError
from smoltorrent.signal_event import SignalEvent


@dataclass
class Part:
    name: str
    argv: list[str]
    grace_s: float
    process: subprocess.Popen | None = None


@dataclass
class Stack:
    """What `up` runs; start(), then wait() until a signal or a death, then stop()."""

    nodes: int = defaults.UP_NODES
    watch: str | None = None
    name_prefix: str = ""
    flower_port: int | None = None
    metrics: bool = False
    metrics_host: str | None = None  # None: the default, 127.0.0.1
    say: Callable[[str], None] = print
    root: Path = field(default_factory=lambda: config.home() / "up")
    parts: list[Part] = field(default_factory=list)
    started_redis: bool = False
    # Set by a signal handler: a threading.Event there can deadlock (smoltorrent/signal_event.py).
    _stop: SignalEvent = field(default_factory=SignalEvent)

    def _cli(self, *argv: str) -> list[str]:
        return [sys.executable, "-m", "coordinator.cli", *argv]

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)
        status = redis_status()
        self.started_redis = bool(status["embedded"] and not status["running"])
        url = ensure_redis_url()
        self.say(f"redis: {redis_status()['url'] if status['embedded'] else config.shown_url(url)}")
        md = Metadata(url)
        for i, (data, port) in enumerate(self._node_places(md)):
            if self._stop.is_set():
                return
            self._node(i, md, data, port)
        self._spawn("worker", self._cli("worker", *self._metrics(defaults.UP_WORKER_METRICS)),
                    defaults.UP_WORKER_GRACE_S)  # fmt: skip
        self._wait_worker(md)
        if self._stop.is_set():
            return
        self._spawn("beat", self._cli("beat"), defaults.UP_GRACE_S)
        if self.watch:
            watch = self._cli("watch", self.watch, "--name-prefix", self.name_prefix)
            self._spawn("watcher", watch, defaults.UP_GRACE_S)
        if self.flower_port is not None:
            self._spawn("flower", self._cli("flower", "--port", str(self.flower_port)),
                        defaults.UP_GRACE_S)  # fmt: skip
            self.say(f"flower: http://127.0.0.1:{self.flower_port}/")
        self.say(f"ready: {', '.join(p.name for p in self.parts)}; logs in {self.root / 'logs'}")

    def _metrics(self, port: int) -> list[str]:
        if not self.metrics:
            return []
        host = ["--metrics-host", self.metrics_host] if self.metrics_host else []
        return ["--metrics-port", str(port), *host]

    def _node_places(self, md: Metadata) -> list[tuple[Path, int]]:
        """Each node's data directory and port. First the nodes this home already has on
        this host (registered with their data directory, by `nodes add` or an earlier
        `up`): the same directory and port, so the same id at the same address, never a
        new node in its place. Then nodes of its own under <root>/nodeN, each on a port no
        registered node has."""
        registered = sorted(md.nodes.nodes().values(), key=lambda r: r.added_at)
        places = [
            (Path(r.data_dir), r.address.port)
            for r in registered
            if r.data_dir and r.host == config.host_id() and r.address.is_loopback()
            if Path(r.data_dir).is_dir()
        ][: self.nodes]
        taken = {r.address.port for r in registered if r.address.is_loopback()}
        mine = {data.resolve() for data, _ in places}
        for i in range(self.nodes * 2):
            if len(places) >= self.nodes:
                break
            data = self.root / f"node{i}"
            if data.resolve() in mine:
                continue
            # The same port every time where it is free, so registered addresses stay put.
            port = defaults.DEFAULT_PORT + i
            places.append((data, port if port not in taken else 0))
        return places

    def _node(self, i: int, md: Metadata, data: Path, port: int) -> None:
        port_file = data / "port"
        address = NodeAddress("127.0.0.1", port)
        if port and not _bindable(port):
            running = _answering(address)
            if running is not None and running.data_dir == str(data.resolve()):
                # This very node runs already (started by hand): used as it is, not stopped.
                self.say(f"node{i}: {running.node_id[:12]} on {address} (already running)")
                return
            port = 0
        port_file.unlink(missing_ok=True)  # a killed node's old one
        argv = [sys.executable, "-m", "worker_server", "--data-dir", str(data)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--no-mdns"]
        argv += self._metrics(defaults.UP_NODE_METRICS + i)
        if config.cluster_key() is not None and key_from_env() is None:
            # The key is the home's file (`smoltorrent init`), which a node never reads by
            # itself; the environment's key or file the nodes inherit.
            argv += ["--key-file", str(config.cluster_key_file())]
        part = self._spawn(f"node{i}", argv, defaults.LOCAL_STOP_TIMEOUT_S)
        deadline = time.monotonic() + defaults.LOCAL_START_TIMEOUT_S
        while not port_file.exists():
            if part.process.poll() is not None or time.monotonic() > deadline:
                raise SmoltorrentError(
                    f"node{i} did not start (port {port} taken?); see {self._log(part.name)}"
                )
            time.sleep(0.05)
        address = NodeAddress("127.0.0.1", int(port_file.read_text()))
        stat = NodeClient(address, cluster_key=config.cluster_key()).stat()
        md.nodes.refuse_second_id(address, stat.node_id)
        # By id, with its directory: a restart (and the next `up`) keeps its shards.
        md.nodes.add_node(stat.node_id, address, local_node(address, stat, config.host_id()))
        md.nodes.mark_alive(stat.node_id, stat.__dict__)
        self.say(f"node{i}: {stat.node_id[:12]} on {address}")

    def _log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def _spawn(self, name: str, argv: list[str], grace_s: float) -> Part:
        part = Part(name, argv, grace_s)
        with open(self._log(name), "ab") as log:
            # A session of its own: the stop reaches its children (a worker's pool) too,
            # and a Ctrl-C in the terminal reaches only `up`, which stops parts in order.
            part.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.parts.append(part)
        return part

    def _wait_worker(self, md: Metadata) -> None:
        worker = self.parts[-1]
        deadline = time.monotonic() + defaults.UP_WORKER_START_S
        while md.nodes.worker_boot(config.host_id()) is None and not self._stop.is_set():
            if worker.process.poll() is not None or time.monotonic() > deadline:
                raise SmoltorrentError(f"the worker did not start; see {self._log('worker')}")
            time.sleep(0.1)
        self.say(f"worker: smoltorrent@{config.host_id()}")

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def wait(self) -> int:
        """Until a stop signal (0) or a part exiting on its own (1)."""
        while not self._stop.wait(defaults.UP_POLL_S):
            for part in self.parts:
                if part.process.poll() is not None:
                    self.say(
                        f"{part.name} exited with {part.process.returncode}; stopping everything"
                        f" (see {self._log(part.name)})"
                    )
                    return 1
        return 0

    def stop(self) -> None:
        for part in reversed(self.parts):
            self._stop_part(part)
        if self.started_redis:
            with contextlib.suppress(SmoltorrentError):
                stop_redis()
        self.say("stopped")

    def _stop_part(self, part: Part) -> None:
        process = part.process
        if process is None:
            return
        # SIGTERM to the part itself, not its group: a worker then shuts down warm, its
        # pool children finishing their transfers instead of dying mid-send.
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(part.grace_s)
        # Whatever is still in its group (a pool child, a stuck process) goes now.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(part.grace_s)


def run_up(stack: Stack) -> int:
    """start, wait, stop: the exit status of `smoltorrent up`."""
    previous = {s: signal.signal(s, stack.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stack.start()
        return stack.wait()
    finally:
        # Once stopping, a second Ctrl-C must not cut the orderly stop short.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        stack.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _answering(address: NodeAddress) -> NodeStat | None:
    """The stat of the node at `address`, or None when none answers there."""
    try:
        return NodeClient(
            address, cluster_key=config.cluster_key(), timeout=defaults.CONNECT_TIMEOUT_S
        ).stat()
    except SmoltorrentError:
        return None
