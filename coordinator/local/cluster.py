"""A complete cluster on this machine: Redis, shard servers and a Celery worker.

Each part is a real separate process on loopback, so `smoltorrent demo`,
the benchmarks and the tests exercise exactly what a user runs by hand.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from coordinator import config
from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.state.embedded_redis import start_redis, url_for
from smoltorrent import defaults
from smoltorrent.errors import SmoltorrentError


def _wait_for(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            hint = f"; see {log}" if log else ""
            raise SmoltorrentError(f"{what} did not start within {timeout:.0f} s{hint}")
        time.sleep(0.05)


class NodeProcess:
    """One `python -m worker_server` child process and the data directory it serves.

    start() keeps the port of an earlier start, so a killed node comes back
    where the cluster expects it, with the same data dir and node id.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        cluster_key: bytes | None = None,
        *,
        socket_timeout: float | None = None,
        env: dict[str, str] | None = None,
        launcher: tuple[str, ...] = (),
        host: str = "127.0.0.1",
    ) -> None:
        self.data_dir = Path(data_dir)
        # The address it binds: loopback, or its own in a network namespace (`ip netns
        # exec NS` in the launcher; beyond loopback a node needs the cluster key).
        self.host = host
        # A program the node runs under, which execs it (same pid): libfiu's `fiu-run -x`
        # in the fault tests, to fail its system calls on demand.
        self.launcher = launcher
        self.cluster_key = cluster_key
        self.socket_timeout = socket_timeout
        self.env = dict(os.environ if env is None else env)
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self.address: NodeAddress | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise SmoltorrentError("the node process is not running")
        return self._process.pid

    def start(self, port: int | None = None) -> NodeProcess:
        """Spawn the node and wait until it has bound its port."""
        return self.spawn(port).wait_started()

    def spawn(self, port: int | None = None) -> NodeProcess:
        """Spawn the node without waiting for it (wait_started waits), so several start at
        once: each spends most of its start-up importing, which overlaps."""
        if port is None:
            port = self.address.port if self.address else 0
        self.data_dir.mkdir(parents=True, exist_ok=True)
        port_file = self.data_dir / "port"
        port_file.unlink(missing_ok=True)  # a SIGKILLed node leaves its old one behind
        env = {k: v for k, v in self.env.items() if k != "SMOLTORRENT_CLUSTER_KEY"}
        if self.cluster_key:
            env["SMOLTORRENT_CLUSTER_KEY"] = self.cluster_key.decode("utf-8")
        command = [*self.launcher, sys.executable, "-m", "worker_server"]
        command += ["--data-dir", str(self.data_dir)]
        command += ["--host", self.host, "--port", str(port)]
        if self.socket_timeout is not None:
            command += ["--socket-timeout", str(self.socket_timeout)]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_started(self) -> NodeProcess:
        """Wait until the spawned node has bound its port (it writes the port file then)."""
        port_file = self.data_dir / "port"
        _wait_for(
            lambda: port_file.exists() or self._process.poll() is not None,
            defaults.LOCAL_START_TIMEOUT_S,
            f"node in {self.data_dir}",
            self.log_path,
        )
        if self._process.poll() is not None:
            raise SmoltorrentError(
                f"node exited with {self._process.returncode} at start:\n{self.log()}"
            )
        self.address = NodeAddress(self.host, int(port_file.read_text()))
        return self

    def log(self) -> str:
        """Everything the node process has logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, *, timeout: float | None = None) -> NodeClient:
        """A client for this node holding the node's own cluster key."""
        if self.address is None:
            raise SmoltorrentError("the node has not been started")
        return NodeClient(self.address, cluster_key=self.cluster_key, timeout=timeout)

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def send_signal(self, signum: int) -> None:
        if self._process is None:
            raise SmoltorrentError("the node process was never started")
        self._process.send_signal(signum)

    def wait(self, timeout: float = defaults.LOCAL_STOP_TIMEOUT_S) -> int:
        """Wait for the process to exit; its exit status."""
        if self._process is None:
            raise SmoltorrentError("the node process was never started")
        return self._process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, like a power cut."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def stop(self) -> int | None:
        """SIGTERM and wait for a clean exit; the exit status (None if it was not running)."""
        if self._process is None or self._process.poll() is not None:
            return None if self._process is None else self._process.returncode
        self.ask_to_stop()
        return self.wait_stopped()

    def ask_to_stop(self) -> None:
        """SIGTERM without waiting (wait_stopped waits), so several nodes stop at once."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)  # a frozen (SIGSTOPped) node cannot exit
            self._process.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> int | None:
        """Wait for the exit ask_to_stop asked for; SIGKILL and SmoltorrentError past
        LOCAL_STOP_TIMEOUT_S."""
        if self._process is None:
            return None
        try:
            return self._process.wait(defaults.LOCAL_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise SmoltorrentError(
                f"node ignored SIGTERM for {defaults.LOCAL_STOP_TIMEOUT_S} s:\n{self.log()}"
            ) from None

    def restart(self) -> NodeProcess:
        """Stop (if running) and start again on the same data dir and port."""
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
    node_launcher: tuple[str, ...] = ()  # what each node runs under (NodeProcess.launcher)
    # Where node i runs, if not on loopback here: (the address it binds, the command that
    # puts it there: `ip netns exec NS`), node_launcher after it. The fault runs' LAN.
    node_places: tuple[tuple[str, tuple[str, ...]], ...] = ()
    node_procs: list[NodeProcess] = field(default_factory=list)
    worker: subprocess.Popen | None = None
    beat: subprocess.Popen | None = None
    redis_pid: int | None = None
    redis_port: int | None = None

    @property
    def redis_url(self) -> str:
        if self.redis_port is None:
            raise SmoltorrentError("the local cluster's Redis is not started yet")
        return url_for(self.root / "redis", self.redis_port)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SMOLTORRENT_REDIS_URL=self.redis_url,
            SMOLTORRENT_HOME=str(self.root),
            SMOLTORRENT_HOST_ID=self.host_id,
            PYTHONUNBUFFERED="1",
        )
        if self.cluster_key:
            env["SMOLTORRENT_CLUSTER_KEY"] = self.cluster_key
        # A local cluster gathers under its own root too (the demo writes its copy there).
        allowed = [str(self.root), *filter(None, [env.get(config.GATHER_DIRS_ENV)])]
        env[config.GATHER_DIRS_ENV] = os.pathsep.join(allowed)
        env.update(self.extra_env)
        return env

    def start_redis(self) -> None:
        self.redis_pid, self.redis_port = start_redis(self.root / "redis", self.redis_port)

    def kill_redis(self) -> None:
        if self.redis_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.redis_pid, signal.SIGKILL)
            _wait_for(lambda: not _alive(self.redis_pid), 10, "redis shutdown")

    def start(self, *, worker: bool = True) -> LocalCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self.start_redis()
        # Everything at once, then wait for each: the worker's boot (Celery, ~2 s) overlaps
        # the nodes' starts. Its boot sweeps find no node registered yet, as in order.
        if worker:
            self.spawn_worker()
        key = self.cluster_key.encode() if self.cluster_key else None
        for i in range(self.nodes):
            host, place = self.node_places[i] if self.node_places else ("127.0.0.1", ())
            node = NodeProcess(
                self.root / f"node{i}",
                key,
                env=self.env(),
                launcher=(*place, *self.node_launcher),
                host=host,
            )
            self.node_procs.append(node.spawn())
        for node in self.node_procs:
            node.wait_started()
        if worker:
            self.wait_for_worker()
        return self

    def _spawn_cli(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`smoltorrent ARGV...` against this cluster (with `env` over its environment),
        logging to <root>/<command>.log, in its own session so a SIGKILL of its group
        takes any children down with it."""
        command = [sys.executable, "-m", "coordinator.cli", *argv]
        with open(self.root / f"{argv[0]}.log", "ab") as log:
            return subprocess.Popen(
                command,
                env={**self.env(), **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start_worker(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        self.spawn_worker(env)
        return self.wait_for_worker()

    def spawn_worker(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        """`smoltorrent worker` (with `env` over the cluster's environment: a skewed clock,
        say), not waited for (wait_for_worker waits)."""
        self.worker = self._spawn_cli(
            "worker", "--loglevel", "INFO", "--concurrency", str(self.worker_concurrency), env=env
        )
        return self.worker

    def wait_for_worker(self) -> subprocess.Popen:
        """Wait until the spawned worker answers a ping; SmoltorrentError if it exits."""
        _wait_for(
            lambda: self.worker.poll() is not None or self.worker_answers(),
            defaults.LOCAL_START_TIMEOUT_S * 4,
            "the Celery worker",
            self.root / "worker.log",
        )
        if self.worker.poll() is not None:
            raise SmoltorrentError(f"the Celery worker exited; see {self.root / 'worker.log'}")
        return self.worker

    def start_beat(self) -> subprocess.Popen:
        """`smoltorrent beat`: the sweeps (health, repair, scrub, ...) on their intervals."""
        self.beat = self._spawn_cli("beat", "--loglevel", "INFO")
        return self.beat

    def stop_beat(self) -> None:
        _terminate(self.beat)

    def kill_beat(self) -> None:
        """SIGKILL beat's whole group."""
        _kill_group(self.beat)

    def worker_answers(self) -> bool:
        """Whether this cluster's worker answers a Celery ping (it is connected and ready)."""
        from celery import Celery

        app = Celery(broker=self.redis_url)
        try:
            # A connection of our own, closed here: the one ping takes from the app's pool
            # stayed open after app.close() (3 of the 7 descriptors a cluster start left).
            with app.connection_for_write() as connection:
                destination = [f"smoltorrent@{self.host_id}"]
                return bool(app.control.ping(destination, timeout=0.5, connection=connection))
        except Exception:  # any broker error means "not answering yet"
            return False
        finally:
            app.close()

    def kill_worker(self) -> None:
        """SIGKILL the whole worker: main process and its pool children."""
        _kill_group(self.worker)

    def stop_worker(self) -> None:
        _terminate(self.worker)

    def stop(self) -> None:
        """SIGTERM to beat, the worker and every node at once, then wait for each: the
        worker's warm shutdown (~2 s) overlaps the nodes'. Redis last, for their last writes."""
        for proc in (self.beat, self.worker):
            if proc and proc.poll() is None:
                proc.terminate()
        for node in self.node_procs:
            node.ask_to_stop()
        for proc in (self.beat, self.worker):
            _wait_or_kill(proc)
        for node in self.node_procs:
            node.wait_stopped()
        if self.redis_pid and _alive(self.redis_pid):
            os.kill(self.redis_pid, signal.SIGTERM)
            _wait_for(lambda: not _alive(self.redis_pid), 10, "redis shutdown")


def _kill_group(proc: subprocess.Popen | None) -> None:
    if proc and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _terminate(proc: subprocess.Popen | None) -> None:
    """SIGTERM, and SIGKILL of its whole group if it has not exited 20 s later."""
    if proc and proc.poll() is None:
        proc.terminate()
        _wait_or_kill(proc)


def _wait_or_kill(proc: subprocess.Popen | None) -> None:
    """Wait 20 s for a process asked to stop, then SIGKILL its whole group."""
    if proc is None:
        return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        _kill_group(proc)


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
    except IndexError:
        return False
    except OSError:
        pass  # no /proc (macOS), or the process is gone: ps tells either way
    try:
        state = subprocess.run(
            ["ps", "-o", "stat=", "-p", str(pid)],
            capture_output=True,
            text=True,
            timeout=defaults.LOCAL_STOP_TIMEOUT_S,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(state) and not state.startswith("Z")
