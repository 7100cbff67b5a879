"""Shard servers as real processes on loopback, for any test package.

node = start_node(tmp_path / "node1", cluster_key=b"secret")
node.client().ping()
node.kill()      # SIGKILL, like a power cut
node.restart()   # same data dir, same port
node.stop()      # SIGTERM, clean exit
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from coordinator.node_client import NodeAddress, NodeClient

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 15.0  # seconds for a node process to bind; a loaded CI box can be slow
STOP_TIMEOUT_S = 15.0  # seconds for SIGTERM to end a node (the server's grace period is 10 s)
POLL_INTERVAL_S = 0.02  # seconds between checks of the port file


class NodeProcess:
    """One `python -m worker_server` child process and the data directory it serves."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        cluster_key: bytes | None = None,
        *,
        socket_timeout: float | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.cluster_key = cluster_key
        self.socket_timeout = socket_timeout
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self.address: NodeAddress | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the node process is not running")
        return self._process.pid

    def start(self, port: int = 0) -> NodeProcess:
        """Spawn the node and wait until it has bound its port."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        port_file = self.data_dir / "port"
        port_file.unlink(missing_ok=True)  # a SIGKILLed node leaves its old one behind
        env = {k: v for k, v in os.environ.items() if k != "SMOLTORRENT_CLUSTER_KEY"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        if self.cluster_key:
            env["SMOLTORRENT_CLUSTER_KEY"] = self.cluster_key.decode("utf-8")
        command = [sys.executable, "-m", "worker_server", "--data-dir", str(self.data_dir)]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        if self.socket_timeout is not None:
            command += ["--socket-timeout", str(self.socket_timeout)]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
            )
        self.address = NodeAddress("127.0.0.1", self._wait_for_port(port_file))
        return self

    def _wait_for_port(self, port_file: Path) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"node exited with {self._process.returncode}:\n{self.log()}")
            try:
                return int(port_file.read_text())
            except (FileNotFoundError, ValueError):
                time.sleep(POLL_INTERVAL_S)
        self.kill()
        raise RuntimeError(f"node did not bind within {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        """Everything the node process has logged so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, *, timeout: float | None = None) -> NodeClient:
        """A client for this node holding the node's own cluster key."""
        if self.address is None:
            raise RuntimeError("the node has not been started")
        return NodeClient(self.address, cluster_key=self.cluster_key, timeout=timeout)

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def send_signal(self, signum: int) -> None:
        if self._process is None:
            raise RuntimeError("the node process was never started")
        self._process.send_signal(signum)

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Wait for the process to exit; its exit status."""
        if self._process is None:
            raise RuntimeError("the node process was never started")
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
        self._process.send_signal(signal.SIGTERM)
        try:
            return self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            message = f"node ignored SIGTERM for {STOP_TIMEOUT_S} s:\n{self.log()}"
            raise RuntimeError(message) from None

    def restart(self) -> NodeProcess:
        """Stop (if running) and start again on the same data dir and port."""
        self.stop()
        return self.start(self.address.port if self.address else 0)


def start_node(
    data_dir: str | os.PathLike[str],
    cluster_key: bytes | None = None,
    *,
    socket_timeout: float | None = None,
) -> NodeProcess:
    """Start a shard server process serving data_dir on a free loopback port."""
    return NodeProcess(data_dir, cluster_key, socket_timeout=socket_timeout).start()
