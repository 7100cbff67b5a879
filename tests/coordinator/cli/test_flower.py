"""`smoltorrent flower` listens on loopback unless told otherwise: it has no login."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from coordinator.local.cluster import LocalCluster
from coordinator.state.embedded_redis import free_port

START_TIMEOUT_S = 60.0  # seconds; Flower imports Celery and Tornado before it listens


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


def test_flower_binds_loopback_by_default(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", nodes=0)
    cluster.root.mkdir(parents=True)
    cluster.start_redis()
    port = free_port()
    flower = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "flower", "--port", str(port)],
        env=cluster.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not listening_addresses(port):
            assert flower.poll() is None, "flower exited"
            assert time.monotonic() < deadline, "flower did not start listening"
            time.sleep(0.1)
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        flower.terminate()
        flower.wait(30)
        cluster.stop()
