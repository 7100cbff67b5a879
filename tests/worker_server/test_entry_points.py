"""serve(), run_from_args() and `python -m worker_server` as a user or the CLI meets them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coordinator.dataplane.node_client import NodeAddress, NodeClient
from tests.nodeproc import NodeProcess, start_node
from worker_server.server import ShardServer, serve

EXIT_TIMEOUT_S = 15.0  # seconds; a failing start must exit well within this


def run_module(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker_server", *args],
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
        env=env,
    )


def test_serve_embedded_in_a_thread(tmp_path: Path) -> None:
    ready = threading.Event()
    servers: list[ShardServer] = []

    def on_ready(server: ShardServer) -> None:
        servers.append(server)
        ready.set()

    thread = threading.Thread(
        target=serve, args=(tmp_path, "127.0.0.1", 0, b"key", on_ready), daemon=True
    )
    thread.start()
    assert ready.wait(10)
    server = servers[0]
    assert (tmp_path / "port").read_text().strip() == str(server.port)
    client = NodeClient(NodeAddress("127.0.0.1", server.port), cluster_key=b"key")
    assert client.ping() == server.store.node_id
    server.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert not (tmp_path / "port").exists()


def test_port_in_use_fails_with_advice(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_module("--data-dir", str(tmp_path), "--port", str(port))
    assert result.returncode == 1
    assert "other process holds the port" in result.stderr


def test_two_nodes_cannot_share_a_data_dir(tmp_path: Path) -> None:
    node = start_node(tmp_path / "data")
    try:
        result = run_module("--data-dir", str(tmp_path / "data"), "--port", "0")
        assert result.returncode == 1
        assert "already serving" in result.stderr
        assert node.client().ping()
    finally:
        node.stop()


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf"])
def test_bad_socket_timeout_is_refused(tmp_path: Path, value: str) -> None:
    result = run_module("--data-dir", str(tmp_path), "--port", "0", "--socket-timeout", value)
    assert result.returncode != 0
    assert "socket timeout" in result.stderr or "invalid float" in result.stderr


def test_sigint_stops_cleanly(tmp_path: Path) -> None:
    node: NodeProcess = start_node(tmp_path / "data")
    node.send_signal(signal.SIGINT)
    assert node.wait(EXIT_TIMEOUT_S) == 0
    assert "listening on 127.0.0.1:" in node.log()
    assert "stopped" in node.log()


@pytest.mark.parametrize("entry", [["-m", "worker_server"], ["-m", "coordinator.cli", "serve"]])
def test_keyless_node_refuses_to_listen_beyond_loopback(tmp_path: Path, entry: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SMOLTORRENT_CLUSTER_KEY"}
    result = subprocess.run(
        [sys.executable, *entry, "--data-dir", str(tmp_path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
        env=env,
    )
    assert result.returncode == 2
    assert "without a cluster key" in result.stderr and "--insecure" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "port").exists()


def test_insecure_flag_allows_a_keyless_node_beyond_loopback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SMOLTORRENT_CLUSTER_KEY"}
    process = subprocess.Popen(
        [sys.executable, "-m", "worker_server", "--data-dir", str(tmp_path), "--port", "0"]
        + ["--host", "0.0.0.0", "--insecure"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:
            if "listening on" in line:
                assert "listening on 0.0.0.0:" in line
                break
        port = int((tmp_path / "port").read_text())
        assert NodeClient(NodeAddress("127.0.0.1", port)).ping()
    finally:
        process.terminate()
        process.wait(EXIT_TIMEOUT_S)


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_port_out_of_range_is_one_line_exit_2(tmp_path: Path, port: str) -> None:
    result = run_module("--data-dir", str(tmp_path), "--port", port)
    assert result.returncode == 2
    assert "is not a TCP port" in result.stderr
    assert "Traceback" not in result.stderr


def test_smoltorrent_serve_and_the_module_take_the_same_options() -> None:
    import re

    def options(argv: list[str]) -> set[str]:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=EXIT_TIMEOUT_S)
        assert out.returncode == 0, out.stderr
        return set(re.findall(r"--[a-z][a-z-]+", out.stdout))

    module = options([sys.executable, "-m", "worker_server", "--help"])
    cli = options([sys.executable, "-m", "coordinator.cli", "serve", "--help"])
    assert module == cli
    assert {"--data-dir", "--port", "--socket-timeout", "--metrics-port"} <= module


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on port."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            found.add(address)
    return found


@pytest.mark.parametrize(
    ("extra", "bound"), [([], "0100007F"), (["--metrics-host", "0.0.0.0"], "00000000")]
)
def test_metrics_listen_on_loopback_unless_told(
    tmp_path: Path, extra: list[str], bound: str
) -> None:
    """Issue 22: a node's /metrics (no auth) listened wherever the node did, 0.0.0.0 with
    a key. Now on 127.0.0.1 unless --metrics-host says otherwise."""
    env = dict(os.environ, SMOLTORRENT_CLUSTER_KEY="metrics-test-key")
    process = subprocess.Popen(
        [sys.executable, "-m", "worker_server", "--data-dir", str(tmp_path), "--port", "0"]
        + ["--host", "0.0.0.0", "--no-mdns", "--metrics-port", "0", *extra],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:
            if "listening on" in line:
                break
        metrics_port = int((tmp_path / "metrics_port").read_text())
        assert _listening(metrics_port) == {bound}
        assert _listening(int((tmp_path / "port").read_text())) == {"00000000"}  # the node itself
    finally:
        process.terminate()
        process.wait(EXIT_TIMEOUT_S)


@pytest.mark.parametrize("entry", [["-m", "worker_server"], ["-m", "coordinator.cli", "serve"]])
def test_a_node_never_reads_the_homes_cluster_key(tmp_path: Path, entry: list[str]) -> None:
    """docs/security.md: a node reads its key from --key-file, SMOLTORRENT_CLUSTER_KEY or
    SMOLTORRENT_CLUSTER_KEY_FILE, never the home's cluster.key by itself (a key makes a
    node listen on every interface, which must be asked for). With only the home's file,
    it is keyless: it refuses beyond loopback, and on loopback speaks without a key."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "cluster.key").write_text("a-key-the-node-must-not-pick-up\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_CLUSTER_KEY")}
    env["SMOLTORRENT_HOME"] = str(home)
    wide = subprocess.run(
        [sys.executable, *entry, "--data-dir", str(tmp_path / "wide"), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
        env=env,
    )
    assert wide.returncode == 2 and "without a cluster key" in wide.stderr
    data = tmp_path / "data"
    process = subprocess.Popen(
        [sys.executable, *entry, "--data-dir", str(data), "--port", "0"],
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while not (data / "port").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        port = int((data / "port").read_text())
        assert NodeClient(NodeAddress("127.0.0.1", port), cluster_key=None).ping()
    finally:
        process.terminate()
        process.wait(EXIT_TIMEOUT_S)
