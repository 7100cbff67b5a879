"""The README's "A real cluster in five minutes", step by step, across machines made of
network namespaces (issue 24): a training box with Redis and the worker, storage nodes on
addresses of their own, and a reader with no worker that restores byte-identical into a
directory outside its home.

Each machine is a namespace with its own address, its own HOME (so its own
~/.smoltorrent) and its own host name for routing (SMOLTORRENT_HOST_ID: namespaces share
the machine's real host name, which real machines do not). Where the README names hosts
(pi1, <training box>), the test gives addresses: the namespaces have no DNS. Beat is left
out: nothing here waits for a sweep.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local import netns
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.embedded_redis import redis_server_binary
from tests.conftest import require_network_namespaces

NODES = ["pi1", "pi2", "pi3"]
MACHINES = ["trainer", *NODES, "reader"]
WAIT_S = 60.0  # seconds for a process to start listening on a loaded 2-core box
COMMAND_TIMEOUT_S = 120.0  # seconds for one command


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Machines:
    """The namespaces and, per machine, its environment and what it runs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lan = netns.Lan(MACHINES, prefix=f"stx{os.getpid() % 10000}", subnet="10.79.0")
        self.procs: list[subprocess.Popen] = []
        self.password = secrets.token_hex(16)
        bin_dir = str(Path(sys.executable).parent)  # `smoltorrent` on PATH, as installed
        base = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_")}
        base["PATH"] = bin_dir + os.pathsep + base.get("PATH", "")
        self.env = {}
        for machine in MACHINES:
            home = root / machine / "home"
            home.mkdir(parents=True)
            self.env[machine] = dict(
                base,
                HOME=str(home),
                SMOLTORRENT_HOST_ID=machine,
                PYTHONUNBUFFERED="1",
            )

    def home(self, machine: str) -> Path:
        return Path(self.env[machine]["HOME"])

    def export_redis_url(self) -> None:
        url = f"redis://:{self.password}@{self.lan.address('trainer')}:6379/0"
        for env in self.env.values():
            env["SMOLTORRENT_REDIS_URL"] = url

    def run(self, machine: str, *argv: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*self.lan.exec_prefix(machine), *argv],
            env=self.env[machine],
            cwd=self.root / machine,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        assert result.returncode == 0, f"{machine}: {' '.join(argv)}: {result.stderr}"
        return result

    def spawn(self, machine: str, name: str, *argv: str) -> Path:
        log = self.root / machine / f"{name}.log"
        with open(log, "wb") as sink:
            self.procs.append(
                subprocess.Popen(
                    [*self.lan.exec_prefix(machine), *argv],
                    env=self.env[machine],
                    cwd=self.root / machine,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return log

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def wait_for_line(log: Path, text: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{log.name}: no {text!r}: {log.read_text()}"
        time.sleep(0.1)


@pytest.fixture
def machines(tmp_path: Path) -> Iterator[Machines]:
    require_network_namespaces()  # fails instead of skipping where CI requires namespaces
    m = Machines(tmp_path)
    try:
        m.lan.open()
        yield m
    finally:
        m.stop()
        left = m.lan.close()
    assert left == [], f"processes left in the namespaces: {left}"


def test_the_readme_cluster_across_machines(machines: Machines, tmp_path: Path) -> None:
    m = machines
    # Once, on the training box: the cluster key, and a Redis the other machines reach.
    init = m.run("trainer", "smoltorrent", "init")
    key_file = m.home("trainer") / ".smoltorrent" / "cluster.key"
    assert "smoltorrent serve --key-file ~/.smoltorrent/cluster.key" in init.stdout
    redis_dir = tmp_path / "trainer" / "redis"
    redis_dir.mkdir()
    redis_log = m.spawn(
        "trainer", "redis", redis_server_binary(), "--bind", "0.0.0.0", "--port", "6379",
        "--requirepass", m.password, "--dir", str(redis_dir), "--appendonly", "yes",
        "--maxmemory-policy", "noeviction", "--save", "",
    )  # fmt: skip
    wait_for_line(redis_log, "Ready to accept connections")

    # Copy the key file to every machine below, the same place on each (the README's ssh
    # line: `mkdir -p ~/.smoltorrent && umask 077 && cat > ~/.smoltorrent/cluster.key`).
    for machine in [*NODES, "reader"]:
        m.run(
            machine,
            "sh",
            "-c",
            "mkdir -p ~/.smoltorrent && umask 077 && cat > ~/.smoltorrent/cluster.key"
            f" < {key_file}",
        )
    # On every machine, the same Redis.
    m.export_redis_url()

    # On each storage node: with the key it listens on every interface, port 7411.
    logs = []
    for node in NODES:
        data = tmp_path / node / "srv"
        logs.append(
            m.spawn(
                node,
                "serve",
                "sh",
                "-c",
                f"exec smoltorrent serve --key-file ~/.smoltorrent/cluster.key --data-dir {data}",
            )  # fmt: skip
        )
    for log in logs:
        wait_for_line(log, "listening on 0.0.0.0:7411")

    # On the training box: register the nodes, run the worker, store.
    m.run("trainer", "smoltorrent", "nodes", "add", *(m.lan.address(n) for n in NODES))
    worker_log = m.spawn("trainer", "worker", "smoltorrent", "worker")
    checkpoint = tmp_path / "trainer" / "checkpoints" / "step_100.safetensors"
    checkpoint.parent.mkdir()
    write_checkpoint(checkpoint, 3_000_000, hidden=128)
    settled = time.time() - 60  # written a minute ago: a store does not wait for it to settle
    os.utime(checkpoint, (settled, settled))
    # A user types the next line seconds later; a store before the worker is up is refused.
    wait_for_line(worker_log, "boot of trainer")
    m.run("trainer", "smoltorrent", "store", "checkpoints/step_100.safetensors")
    m.run("trainer", "smoltorrent", "status")

    # On any machine, a reader with no worker too: restore anywhere it can write.
    restored = tmp_path / "reader" / "data" / "step_100.safetensors"
    restored.parent.mkdir()
    assert not restored.is_relative_to(m.home("reader"))
    m.run("reader", "smoltorrent", "gather", "step_100.safetensors", "-o", str(restored))
    assert sha256(restored) == sha256(checkpoint)
    # The training box's worker ran the store; the reader's own process ran the gather.
    events = worker_log.read_text()
    assert "event=done task=store " in events and "task=gather " not in events
