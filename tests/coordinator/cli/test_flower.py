"""`smoltorrent flower`: loopback unless told otherwise (it has no login), readable task
arguments in its task list, and nothing left running once it is stopped."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local.cluster import LocalCluster
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.embedded_redis import free_port
from coordinator.state.metadata import Metadata

START_TIMEOUT_S = 60.0  # seconds; Flower imports Celery and Tornado before it listens
TASKS_TIMEOUT_S = 120.0  # seconds for a store's tasks to reach Flower's list
AUTH = "smol:torrent"  # Flower's API answers only with a login (or FLOWER_UNAUTHENTICATED_API)


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on port."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def session_members(sid: int) -> list[str]:
    """`pid cmdline` of every live process in session `sid`, as ps would list them."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile
        fields = stat.rpartition(")")[2].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # after the name: state, ppid, pgrp, sid
            out.append(f"{entry.name} {cmdline}")
    return out


class Flower:
    """`smoltorrent flower` in a session of its own, so every process it starts is found."""

    def __init__(self, env: dict[str, str], *extra: str) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "flower", "--port", str(self.port), *extra],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not listening_addresses(self.port):
            assert self.process.poll() is None, "flower exited"
            assert time.monotonic() < deadline, "flower did not start listening"
            time.sleep(0.1)

    def stop(self) -> list[str]:
        """SIGTERM to the command, as a user's Ctrl-C or systemd would send it; then the
        processes of its session still alive, which must be none."""
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        left = session_members(self.process.pid)
        if left:
            os.killpg(self.process.pid, signal.SIGKILL)  # clean up, then fail the test
        return left


@pytest.fixture
def redis_only(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path / "cluster", nodes=0)
    cluster.root.mkdir(parents=True)
    cluster.start_redis()
    yield cluster
    cluster.stop()


def test_flower_binds_loopback_by_default_and_leaves_nothing_behind(
    redis_only: LocalCluster,
) -> None:
    flower = Flower(redis_only.env())
    try:
        flower.wait_listening()
        assert listening_addresses(flower.port) == {"0100007F"}  # 127.0.0.1, nothing else
        with socket.create_connection(("127.0.0.1", flower.port), timeout=5):
            pass
    finally:
        left = flower.stop()
    assert left == [], f"still running after SIGTERM: {left}"
    assert not listening_addresses(flower.port)


def _api_tasks(port: int) -> dict[str, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/tasks")
    request.add_header("Authorization", "Basic " + base64.b64encode(AUTH.encode()).decode())
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def _wait_for_tasks(port: int, names: set[str]) -> dict[str, dict]:
    deadline = time.monotonic() + TASKS_TIMEOUT_S
    while True:
        tasks = _api_tasks(port)
        seen = {t["name"] for t in tasks.values()}
        done = all(t["state"] == "SUCCESS" for t in tasks.values() if t["name"] in names)
        if names <= seen and done:
            return tasks
        assert time.monotonic() < deadline, f"Flower lists {sorted(seen)}, not all of {names}"
        time.sleep(0.5)


def test_flower_lists_a_store_with_readable_arguments(tmp_path: Path) -> None:
    # Whole shards, one per node: two chains to list (in chunks this file is one chunk).
    # Beat runs, its sweeps every second or two: the frequent ones (health, repair,
    # reconcile) must not bury the store in Flower; a rarer one (retention) is listed.
    sweeps = {
        "SMOLTORRENT_HEALTH_INTERVAL_S": "1",
        "SMOLTORRENT_REPAIR_INTERVAL_S": "1",
        "SMOLTORRENT_RECONCILE_INTERVAL_S": "1",
        "SMOLTORRENT_RETENTION_INTERVAL_S": "2",
    }
    cluster = LocalCluster(
        tmp_path / "cluster",
        nodes=2,
        host_id="flowertest",
        extra_env={"SMOLTORRENT_CHUNKS": "0", **sweeps},
    )
    cluster.start()
    cluster.start_beat()
    flower = None
    try:
        env = dict(cluster.env(), FLOWER_BASIC_AUTH=AUTH)
        flower = Flower(env)
        flower.wait_listening()
        cli = [sys.executable, "-m", "coordinator.cli"]
        nodes = [str(n.address) for n in cluster.node_procs]
        subprocess.run([*cli, "nodes", "add", *nodes], env=env, check=True, capture_output=True)
        source = tmp_path / "step_100.safetensors"
        size = write_checkpoint(source, 2_000_000, hidden=128)
        os.utime(source, (time.time() - 60, time.time() - 60))  # settled: stored at once
        stored = subprocess.run(
            [*cli, "store", str(source), "--name", "run1/step_100.safetensors", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stored.returncode == 0, stored.stderr
        node_ids = {n.client().stat().node_id[:12] for n in cluster.node_procs}

        md = Metadata(cluster.redis_url)
        deadline = time.monotonic() + TASKS_TIMEOUT_S
        while len(md.sweeps.sweep_runs("health")) < 3:  # the sweeps ran, and were sent
            assert time.monotonic() < deadline, "beat ran no health sweep"
            time.sleep(0.2)
        tasks = _wait_for_tasks(
            flower.port,
            {
                "smoltorrent.store",
                "smoltorrent.chain",
                "smoltorrent.commit",
                "smoltorrent.sweep.retention",
            },
        )
        quiet = {
            "smoltorrent.sweep.health",
            "smoltorrent.sweep.repair",
            "smoltorrent.sweep.reconcile",
        }
        assert not quiet & {t["name"] for t in tasks.values()}, sorted(
            t["name"] for t in tasks.values()
        )
        by_name: dict[str, list[dict]] = {}
        for task in tasks.values():
            by_name.setdefault(task["name"], []).append(task)

        (store,) = by_name["smoltorrent.store"]
        assert store["args"] == "run1/step_100.safetensors"
        assert store["kwargs"] == f"from {source}, 2 copies"
        chains = by_name["smoltorrent.chain"]
        assert len(chains) == 2  # 2 shards (one per node), each sent once down its chain
        lines = set()
        for t in chains:
            assert t["args"] == "run1/step_100.safetensors"
            # "shard 0 -> nodes 1a2b3c4d5e6f -> 6f5e4d3c2b1a (copies 1, 2)": no raw dict
            shard, _, rest = t["kwargs"].partition(" -> nodes ")
            nodes, _, copies = rest.partition(" (copies ")
            assert shard in ("shard 0", "shard 1") and copies == "1, 2)", t["kwargs"]
            assert set(nodes.split(" -> ")) == node_ids, t["kwargs"]
            lines.add(shard)
        assert len(lines) == 2
        (commit,) = by_name["smoltorrent.commit"]
        assert commit["args"] == "run1/step_100.safetensors"
        # The version id the CLI printed, not the internal version key.
        assert commit["kwargs"] == f"version {json.loads(stored.stdout)['version_id'][:12]}"
        assert size > 500_000

        _check_rendered_page(tmp_path, flower.port)
    finally:
        left = flower.stop() if flower else []
        cluster.stop()
    assert left == [], f"still running after SIGTERM: {left}"


def _check_rendered_page(tmp_path: Path, port: int) -> None:
    """Flower's tasks page as a browser renders it (its table is filled by JavaScript)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:  # the API check above passed; this one needs a browser
        pytest.skip("Flower's API lists the store readably; its rendered page needs chromium")
    url = f"http://{AUTH}@127.0.0.1:{port}/tasks"
    headless = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    headless += [f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=10000"]
    dom = subprocess.run(
        [*headless, "--dump-dom", url], capture_output=True, text=True, timeout=120
    ).stdout
    (tmp_path / "dom.html").write_text(dom)
    assert "run1/step_100.safetensors" in dom and "shard 1 -&gt; node" in dom, dom[-2000:]
    assert "'vkey'" not in dom
    shot = tmp_path / "flower-tasks.png"
    subprocess.run(
        [*headless, "--window-size=1600,900", f"--screenshot={shot}", url],
        capture_output=True,
        timeout=120,
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000  # a page with a table, not a blank one


def test_flower_beyond_loopback_needs_a_login_or_insecure(redis_only: LocalCluster) -> None:
    """Issue 22: `flower --address 0.0.0.0` was accepted without auth, although Flower can
    revoke tasks and shows every checkpoint's name. Now it is refused, saying how."""
    env = {k: v for k, v in redis_only.env().items() if not k.startswith("FLOWER_")}
    refused = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "flower", "--address", "0.0.0.0"]
        + ["--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert refused.returncode == 2, refused.stderr
    assert "--basic-auth" in refused.stderr and "--insecure" in refused.stderr
    assert "Traceback" not in refused.stderr
    # Flower takes the last --address it is given: one passed through after `--` is the
    # address it listens on, and is judged as such.
    for passed in (["--", "--address=0.0.0.0"], ["--", "--address", "0.0.0.0"]):
        refused = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "flower", "--port", str(free_port())]
            + passed,
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
        assert refused.returncode == 2, (passed, refused.stderr)
        assert "refusing to run Flower on 0.0.0.0" in refused.stderr

    # With a login (Flower's own option, or its variable), it listens where asked.
    flower = Flower(dict(env, FLOWER_BASIC_AUTH=AUTH), "--address", "0.0.0.0")
    try:
        flower.wait_listening()
        assert listening_addresses(flower.port) == {"00000000"}  # 0.0.0.0
    finally:
        assert flower.stop() == []
    flower = Flower(env, "--address", "0.0.0.0", "--insecure")
    try:
        flower.wait_listening()
        assert listening_addresses(flower.port) == {"00000000"}
    finally:
        assert flower.stop() == []
