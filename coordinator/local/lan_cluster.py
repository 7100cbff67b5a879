"""A whole cluster on an emulated LAN (coordinator/local/netns.py): Redis, the Celery
worker and the CLI in the coordinator's namespace, each storage node in its own, every
one a real process. The Pi-cluster benchmark and the link-cut tests run on it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from coordinator.local.netns import Lan
from coordinator.state.embedded_redis import redis_server_binary
from smoltorrent import defaults

ROOT = Path(__file__).resolve().parents[2]  # the checkout the processes import from
REDIS_PORT = 6390  # on the coordinator namespace's own loopback: clashes with nothing
START_TIMEOUT_S = 60.0  # seconds for Redis, the worker and the nodes to come up, loaded box


class LanCluster:
    """Start with start(), stop with stop(); the Lan is opened and closed by the caller."""

    def __init__(
        self,
        lan: Lan,
        root: Path,
        nodes: list[str],
        extra_env: dict[str, str],
        *,
        coordinator: str = "coord",
    ) -> None:
        self.lan = lan
        self.root = root
        self.nodes = nodes
        self.coordinator = coordinator
        self.procs: list[subprocess.Popen] = []
        self.node_procs: dict[str, subprocess.Popen] = {}
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "SMOLTORRENT_HOME": str(root / "home"),
            "SMOLTORRENT_REDIS_URL": f"redis://127.0.0.1:{REDIS_PORT}/0",
            "SMOLTORRENT_CLUSTER_KEY": secrets.token_hex(32),  # nodes listen beyond loopback
            "SMOLTORRENT_HOST_ID": "lan-coordinator",
            # Gathers write only where allowed (safe defaults): the cluster's own directory.
            "SMOLTORRENT_GATHER_DIRS": str(root),
            **extra_env,
        }

    def node_address(self, node: str) -> str:
        return f"{self.lan.address(node)}:{defaults.DEFAULT_PORT}"

    def _spawn(self, host: str, argv: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.root / log_name, "ab")  # noqa: SIM115 (kept open for the child)
        proc = subprocess.Popen(
            [*self.lan.exec_prefix(host), *argv], env=self.env, stdout=log, stderr=log
        )
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        redis_dir = self.root / "redis"
        redis_dir.mkdir(parents=True)
        self._spawn(self.coordinator, [redis_server_binary(), "--port", str(REDIS_PORT),
                                       "--bind", "127.0.0.1", "--dir", str(redis_dir),
                                       "--appendonly", "yes", "--save", ""],
                    "redis.log")  # fmt: skip
        for node in self.nodes:
            argv = [sys.executable, "-m", "worker_server", "--data-dir", str(self.root / node),
                    "--host", self.lan.address(node),
                    "--port", str(defaults.DEFAULT_PORT)]  # fmt: skip
            self.node_procs[node] = self._spawn(node, argv, f"{node}.log")
        deadline = time.monotonic() + START_TIMEOUT_S
        self._wait_for(b"Ready to accept connections", "redis.log", deadline)
        self._spawn(self.coordinator, [sys.executable, "-m", "coordinator.cli", "worker",
                                       "--loglevel", "INFO"], "worker.log")  # fmt: skip
        self._wait_for(b" ready.", "worker.log", deadline)
        while True:
            added = self.cli("nodes", "add", *map(self.node_address, self.nodes), check=False)
            if added.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes did not answer: {added.stderr}")
            time.sleep(0.5)

    def start_beat(self) -> subprocess.Popen:
        """`smoltorrent beat` in the coordinator's namespace (its log: beat.log)."""
        argv = [sys.executable, "-m", "coordinator.cli", "beat", "--loglevel", "INFO"]
        return self._spawn(self.coordinator, argv, "beat.log")

    def _wait_for(self, line: bytes, log_name: str, deadline: float) -> None:
        log = self.root / log_name
        while line not in log.read_bytes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{line.decode()!r} never came; see {log}")
            time.sleep(0.1)

    def cli_argv(self, *argv: str) -> list[str]:
        """A CLI command run in the coordinator's namespace, as a Popen argv."""
        return [*self.lan.exec_prefix(self.coordinator), sys.executable, "-m",
                "coordinator.cli", *argv]  # fmt: skip

    def cli(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self.cli_argv(*argv), env=self.env, capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise RuntimeError(f"smoltorrent {' '.join(argv)}: {proc.stderr or proc.stdout}")
        return proc

    def cli_json(self, *argv: str) -> Any:
        return json.loads(self.cli(*argv, "--json").stdout)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
