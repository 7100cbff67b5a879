"""The README's "A real cluster in five minutes", run as written, across machines made of
network namespaces: its shell blocks marked `shell-test: cluster MACHINE...`, in the
README's order, each on the machines it names (a training box with Redis, the worker and
beat; four storage nodes; a reader with no worker that restores byte-identical).

Each machine is a namespace with its own address, its own HOME (so its own
~/.smoltorrent), its own host name for routing (SMOLTORRENT_HOST_ID: namespaces share the
machine's real host name, which real machines do not), and one bash that runs its blocks
one after the other, as a person's terminal on it would (an `export` stays for the next
block, `cmd &` keeps running). The names the README uses resolve on every machine
(`ip netns exec` puts /etc/netns/NS/hosts in place of /etc/hosts), and `ssh HOST CMD` runs
CMD on HOST, as that machine's user, with the caller's input: the only stand-in, for the
transport the README assumes. `<password>` is the one text filled in. The test waits, as a
person would, for Redis and the nodes to come up before the blocks that use them.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import stat
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
from tests.test_docs_shell import ROOT, blocks_of

NODES = ["pi1", "pi2", "pi3", "pi4"]
MACHINES = ["trainer", *NODES, "reader"]
STEPS = [b for b in blocks_of(ROOT / "README.md") if b.cluster]
WAIT_S = 60.0  # seconds for a process to come up on a loaded 2-core box
BLOCK_TIMEOUT_S = 180.0  # seconds for one block (the store waits for the worker's boot)
STOP_GRACE_S = 20.0  # seconds for a machine's processes to stop on SIGTERM before SIGKILL
# What a person waits to see on a machine before the next step uses it.
READY = {
    "redis-server redis.conf &": "Ready to accept connections",
    "smoltorrent serve": "listening on",
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Machine:
    """One namespace and the bash that runs its blocks, its output in one log."""

    def __init__(self, lan: netns.Lan, name: str, root: Path, env: dict[str, str]) -> None:
        self.name = name
        self.home = root / name / "home"
        self.home.mkdir(parents=True)
        self.log = root / name / "terminal.log"
        self.blocks = 0
        with open(self.log, "wb") as sink:
            self.shell = subprocess.Popen(
                [*lan.exec_prefix(name), "bash", "--noprofile", "--norc"],
                stdin=subprocess.PIPE,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=dict(env, HOME=str(self.home), SMOLTORRENT_HOST_ID=name),
                cwd=self.home,
                text=True,
                start_new_session=True,
            )
        self.send("set -euo pipefail")

    def send(self, code: str) -> None:
        assert self.shell.stdin is not None
        self.shell.stdin.write(code + "\n")
        self.shell.stdin.flush()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert self.shell.poll() is None, f"{self.name}: {what} failed:\n{self.output()}"
            assert time.monotonic() < deadline, f"{self.name}: no {what}:\n{self.output()}"
            time.sleep(0.1)

    def run(self, code: str) -> None:
        """Run a block as typed at this machine's prompt; fails if a command of it fails."""
        self.blocks += 1
        done = f"__block_{self.blocks}_done__"
        self.send(f"{code}\necho {done}")
        self.wait_for(done, BLOCK_TIMEOUT_S, f"end of block {self.blocks}")

    def stop(self) -> None:
        for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.shell.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.shell.poll()  # reaped: a zombie shell would keep its group alive
                try:
                    os.killpg(self.shell.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)


@pytest.fixture
def lan(tmp_path: Path) -> Iterator[netns.Lan]:
    require_network_namespaces()  # fails instead of skipping where CI requires namespaces
    lan = netns.Lan(MACHINES, prefix=f"stx{os.getpid() % 10000}", subnet="10.79.0")
    hosts = "".join(f"{lan.address(m)} {m}\n" for m in MACHINES)
    etc = [Path("/etc/netns") / lan.ns(m) for m in MACHINES]
    try:
        for d in etc:
            d.mkdir(parents=True)
            (d / "hosts").write_text(f"127.0.0.1 localhost\n{hosts}")
        lan.open()
        yield lan
    finally:
        left = lan.close()
        for d in etc:
            shutil.rmtree(d, ignore_errors=True)
    assert left == [], f"processes left in the namespaces: {left}"


def commands_dir(lan: netns.Lan, root: Path) -> Path:
    """`smoltorrent` as installed, `redis-server`, and `ssh HOST CMD` between machines."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "smoltorrent").symlink_to(Path(sys.executable).parent / "smoltorrent")
    (bin_dir / "redis-server").symlink_to(redis_server_binary())
    ssh = bin_dir / "ssh"
    cases = "".join(
        f"  {m}) exec ip netns exec {lan.ns(m)} env HOME={root / m / 'home'}"
        f' SMOLTORRENT_HOST_ID={m} sh -c "$*" ;;\n'
        for m in MACHINES
    )
    ssh.write_text(f"#!/bin/sh\nhost=$1; shift\ncase $host in\n{cases}  *) exit 255 ;;\nesac\n")
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def test_the_readme_cluster_runs_as_written_across_machines(lan: netns.Lan, tmp_path: Path):
    assert [b.cluster for b in STEPS] == [
        ["trainer"],
        ["trainer"],
        NODES,
        ["trainer"],
        ["reader"],
    ], "the README's cluster steps changed: this test runs them in order, on their machines"
    password = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_")}
    env["PATH"] = f"{commands_dir(lan, tmp_path)}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    machines = {m: Machine(lan, m, tmp_path, env) for m in MACHINES}
    try:
        # What training wrote, in the training box's working directory, a minute ago.
        checkpoint = machines["trainer"].home / "checkpoints" / "step_100.safetensors"
        checkpoint.parent.mkdir()
        write_checkpoint(checkpoint, 3_000_000, hidden=128)
        os.utime(checkpoint, (time.time() - 60, time.time() - 60))

        for step in STEPS:
            code = step.code.replace("<password>", password)
            for name in step.cluster:
                machines[name].run(code)
            for command, ready in READY.items():
                if command in code:
                    for name in step.cluster:
                        machines[name].wait_for(ready, WAIT_S, ready)

        restored = machines["reader"].home / "restored" / "step_100.safetensors"
        assert sha256(restored) == sha256(checkpoint)
        # The training box's worker ran the store; the reader's own process the gather.
        trainer = machines["trainer"].output()
        assert "event=done task=store " in trainer and "task=gather " not in trainer
    finally:
        for machine in machines.values():
            machine.stop()
