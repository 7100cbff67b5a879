"""`smoltorrent up`: one command runs a whole stack, stores and gathers go through it, and
SIGTERM leaves not one of its processes behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from coordinator.local.synthetic import write_checkpoint
from coordinator.state.embedded_redis import free_port

READY_TIMEOUT_S = 180.0  # seconds; four nodes, a Celery worker, beat and Flower on 2 busy cores
STOP_TIMEOUT_S = 120.0  # seconds; within the worker's 60 s grace and every other part's 15 s


def processes_with_home(home: Path) -> list[str]:
    """`pid cmdline` of every process whose environment names this home: everything `up`
    started (and their children) inherits SMOLTORRENT_HOME; and of one working in the home,
    as its embedded redis-server does, whose title overwrites its environment."""
    needle = f"SMOLTORRENT_HOME={home}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            in_home = Path(os.readlink(entry / "cwd")).is_relative_to(home)
            if not in_home and needle not in (entry / "environ").read_bytes() + b"\0":
                continue
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if state != "Z":
            found.append(f"{entry.name} {cmdline}")
    return found


def test_up_runs_a_stack_that_stores_gathers_and_stops_cleanly(tmp_path: Path) -> None:
    home = tmp_path / "home"
    watched = tmp_path / "watched"
    watched.mkdir()
    env = _up_env(tmp_path, home)
    cli = [sys.executable, "-m", "coordinator.cli"]
    log = tmp_path / "up.log"
    up = _start_up(env, log, "--watch", str(watched), "--flower", "--flower-port", str(free_port()))
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        text = _ready(up, log)
        for part in ("node0", "node3", "worker", "beat", "watcher", "flower"):
            assert part in text.split("up: ready:")[1].split(";")[0], text

        def run(*argv: str) -> subprocess.CompletedProcess[str]:
            done = subprocess.run([*cli, *argv], env=env, capture_output=True, text=True)
            assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
            return done

        assert len(json.loads(run("nodes", "ls", "--json").stdout)) == 4
        source = tmp_path / "step_1.safetensors"
        write_checkpoint(source, 3_000_000, hidden=128)
        os.utime(source, (time.time() - 60, time.time() - 60))
        run("store", str(source))
        out = tmp_path / "back.safetensors"
        run("gather", "step_1.safetensors", "-o", str(out))
        assert out.read_bytes() == source.read_bytes()

        # The watcher is part of it: a checkpoint written under the watched dir is stored.
        write_checkpoint(watched / "w.safetensors", 500_000, hidden=64)
        while not any(r["name"] == "w.safetensors" for r in json.loads(run("ls", "--json").stdout)):
            assert time.monotonic() < deadline + READY_TIMEOUT_S, "the watcher stored nothing"
            time.sleep(0.5)
        assert processes_with_home(home)  # the check below sees them while they run
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            code = up.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        left = processes_with_home(home)
        for line in left:  # clean up before failing
            os.kill(int(line.split()[0]), signal.SIGKILL)
    assert code == 0, log.read_text()
    assert left == [], "still running after up stopped:\n" + "\n".join(left)
    assert "up: stopped" in log.read_text()


def _up_env(tmp_path: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SMOLTORRENT_REDIS_URL"}
    env |= {"SMOLTORRENT_HOME": str(home), "SMOLTORRENT_HOST_ID": "uptest"}
    return env | {"SMOLTORRENT_GATHER_DIRS": str(tmp_path), "PYTHONUNBUFFERED": "1"}


def _cli(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *argv], env=env, capture_output=True, text=True
    )


def _serve(env: dict[str, str], data: Path, port: int) -> subprocess.Popen:
    argv = ["serve", "--data-dir", str(data), "--port", str(port), "--no-mdns"]
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _add(env: dict[str, str], *addresses: str) -> subprocess.CompletedProcess[str]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while (added := _cli(env, "nodes", "add", *addresses)).returncode != 0:
        if "does not answer" not in added.stderr and "refused" not in added.stderr:
            return added
        assert time.monotonic() < deadline, added.stderr
        time.sleep(0.2)
    return added


def _start_up(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "up", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _ready(up: subprocess.Popen, log: Path) -> str:
    """The log of `up` once it says it is ready."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "up: ready" not in (text := log.read_text()):
        assert up.poll() is None, f"up exited {up.returncode}:\n{text}"
        assert time.monotonic() < deadline, f"up did not get ready:\n{text}"
        time.sleep(0.2)
    return text


def _run_up(env: dict[str, str], log: Path, nodes: int, then) -> None:
    """`up --nodes N` until ready, then(), then SIGTERM; nothing of it left running."""
    up = _start_up(env, log, "--nodes", str(nodes))
    try:
        _ready(up, log)
        then()
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(STOP_TIMEOUT_S) == 0, log.read_text()


def test_up_reuses_the_nodes_the_home_has_and_one_address_takes_one_id(tmp_path: Path) -> None:
    """Nodes started by hand and registered (docs/operations.md), then stopped, then `up`:
    it started nodes of its own at their addresses, so the home had 4 ids, 2 down, and its
    checkpoints at 0/2. Now `up` starts the home's nodes again from their data directories
    (same ids, same addresses), again on every `up`; and `nodes add` refuses a second id at
    an address, saying how to let the first go."""
    home = tmp_path / "home"
    env = _up_env(tmp_path, home)
    try:
        _reuse_the_home_nodes(tmp_path, home, env)
    finally:  # the first `nodes add` started the embedded Redis, so `up` left it running
        _cli(env, "redis", "stop")
    assert processes_with_home(home) == []


def _reuse_the_home_nodes(tmp_path: Path, home: Path, env: dict[str, str]) -> None:
    ports = [free_port(), free_port()]
    by_hand = [_serve(env, tmp_path / f"st{i}", port) for i, port in enumerate(ports)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    try:
        added = _add(env, *addresses)
        assert added.returncode == 0, added.stderr
    finally:
        for node in by_hand:
            node.terminate()
            node.wait(STOP_TIMEOUT_S)
    ids = {
        n["node_id"]: n["address"] for n in json.loads(_cli(env, "nodes", "ls", "--json").stdout)
    }
    assert sorted(ids.values()) == sorted(addresses)
    source = tmp_path / "m.safetensors"
    write_checkpoint(source, 500_000, hidden=64)
    os.utime(source, (time.time() - 60, time.time() - 60))

    def first() -> None:
        nodes = json.loads(_cli(env, "nodes", "ls", "--json").stdout)
        assert {n["node_id"]: n["address"] for n in nodes} == ids, nodes
        assert all(n["up"] for n in nodes), nodes
        stored = _cli(env, "store", str(source), "--replicas", "2")
        assert stored.returncode == 0, stored.stdout + stored.stderr

    _run_up(env, tmp_path / "up1.log", 2, first)

    def second() -> None:
        nodes = json.loads(_cli(env, "nodes", "ls", "--json").stdout)
        assert {n["node_id"]: n["address"] for n in nodes} == ids, nodes
        status = _cli(env, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        out = tmp_path / "back.safetensors"
        gathered = _cli(env, "gather", "m.safetensors", "-o", str(out))
        assert gathered.returncode == 0, gathered.stderr
        assert out.read_bytes() == source.read_bytes()

    _run_up(env, tmp_path / "up2.log", 2, second)

    stranger = _serve(env, tmp_path / "stranger", ports[0])
    try:
        refused = _add(env, addresses[0])
    finally:
        stranger.terminate()
        stranger.wait(STOP_TIMEOUT_S)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    old = next(n for n, a in ids.items() if a == addresses[0])
    assert f"{addresses[0]} is registered to node {old[:12]}" in refused.stderr
    assert f"smoltorrent nodes rm {old[:12]}" in refused.stderr
    assert len(json.loads(_cli(env, "nodes", "ls", "--json").stdout)) == 2
