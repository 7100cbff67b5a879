"""A complete cluster on this machine: Redis, shard servers and a Celery worker.

Each part is a real separate process on loopback, so `smoltorrent demo`,
the benchmarks and the tests exercise exactly what a user runs by hand.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.embedded_redis import start_redis
from coordinator.node_client import NodeAddress
from smoltorrent import defaults
from smoltorrent.errors import SmoltorrentError


def _wait_for(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            hint = f"; see {log}" if log else ""
            raise SmoltorrentError(f"{what} did not start within {timeout:.0f} s{hint}")
        time.sleep(0.05)


@dataclass
class NodeProcess:
    """One `smoltorrent serve` process; restart() keeps its data dir and port."""

    data_dir: Path
    env: dict[str, str]
    port: int = 0
    proc: subprocess.Popen | None = None

    def start(self) -> NodeProcess:
        port_file = self.data_dir / "port"
        if port_file.exists():
            port_file.unlink()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir.parent / f"{self.data_dir.name}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker_server", "--data-dir", str(self.data_dir),
             "--host", "127.0.0.1", "--port", str(self.port)],
            env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        _wait_for(lambda: port_file.exists() or self.proc.poll() is not None,
                  defaults.LOCAL_START_TIMEOUT_S, f"node in {self.data_dir}")
        if self.proc.poll() is not None:
            raise SmoltorrentError(f"node in {self.data_dir} exited at start; see "
                                   f"{self.data_dir.parent / (self.data_dir.name + '.log')}")
        self.port = int(port_file.read_text())
        return self

    @property
    def address(self) -> NodeAddress:
        return NodeAddress("127.0.0.1", self.port)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: no goodbye, like a Pi losing power."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> NodeProcess:
        self.stop()
        return self.start()


@dataclass
class LocalCluster:
    """Redis with AOF, `nodes` shard servers and (optionally) one Celery worker, under root."""

    root: Path
    nodes: int = 4
    host_id: str = "local"
    cluster_key: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    worker_concurrency: int = defaults.WORKER_CONCURRENCY
    node_procs: list[NodeProcess] = field(default_factory=list)
    worker: subprocess.Popen | None = None
    redis_pid: int | None = None
    redis_port: int | None = None

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(SMOLTORRENT_REDIS_URL=self.redis_url, SMOLTORRENT_HOME=str(self.root),
                   SMOLTORRENT_HOST_ID=self.host_id, PYTHONUNBUFFERED="1")
        if self.cluster_key:
            env["SMOLTORRENT_CLUSTER_KEY"] = self.cluster_key
        env.update(self.extra_env)
        return env

    def start_redis(self) -> None:
        self.redis_pid, self.redis_port = start_redis(self.root / "redis", self.redis_port)

    def kill_redis(self) -> None:
        if self.redis_pid:
            try:
                os.kill(self.redis_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_for(lambda: not _alive(self.redis_pid), 10, "redis shutdown")

    def start(self, *, worker: bool = True) -> LocalCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self.start_redis()
        for i in range(self.nodes):
            self.node_procs.append(
                NodeProcess(self.root / f"node{i}", self.env()).start())
        if worker:
            self.start_worker()
        return self

    def start_worker(self) -> subprocess.Popen:
        log = open(self.root / "worker.log", "ab")
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "worker", "--loglevel", "INFO",
             "--concurrency", str(self.worker_concurrency)],
            env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        _wait_for(lambda: self.worker.poll() is not None or self.worker_answers(),
                  defaults.LOCAL_START_TIMEOUT_S * 4, "the Celery worker", self.root / "worker.log")
        if self.worker.poll() is not None:
            raise SmoltorrentError(f"the Celery worker exited; see {self.root / 'worker.log'}")
        return self.worker

    def worker_answers(self) -> bool:
        """Whether this cluster's worker answers a Celery ping (it is connected and ready)."""
        from celery import Celery

        app = Celery(broker=self.redis_url)
        try:
            return bool(app.control.ping(destination=[f"smoltorrent@{self.host_id}"],
                                         timeout=0.5))
        except Exception:  # any broker error means "not answering yet"
            return False
        finally:
            app.close()

    def kill_worker(self) -> None:
        """SIGKILL the whole worker: main process and its pool children."""
        if self.worker and self.worker.poll() is None:
            os.killpg(self.worker.pid, signal.SIGKILL)
            self.worker.wait()

    def stop_worker(self) -> None:
        if self.worker and self.worker.poll() is None:
            self.worker.terminate()
            try:
                self.worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill_worker()

    def stop(self) -> None:
        self.stop_worker()
        for node in self.node_procs:
            node.stop()
        if self.redis_pid and _alive(self.redis_pid):
            os.kill(self.redis_pid, signal.SIGTERM)
            _wait_for(lambda: not _alive(self.redis_pid), 10, "redis shutdown")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child still answers kill(0); reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False
