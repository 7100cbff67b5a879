"""The emulated LAN's cuts (coordinator/local/netns.py) on real namespaces and sockets: a
severed pair cannot reach each other and every other pair still can; a run killed before
close() leaves nothing once the next run calls remove_stale."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from coordinator.local import netns
from tests.conftest import require_network_namespaces

PORT = 7000
HOSTS = ["co", "n0", "n1"]
CONNECT_TIMEOUT_S = 1.0  # a severed pair's connect hangs (packets vanish): this ends it
RECONNECT_ATTEMPTS = 5  # connects tried after a cable is back (`any` stops at the first)

_REACH = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as s:
        print(s.recv(2).decode())
except OSError as exc:
    print(type(exc).__name__)
"""
_SERVE = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(b"hi")
    conn.close()
"""


@pytest.fixture
def lan() -> Iterator[netns.Lan]:
    require_network_namespaces()
    with netns.subnet_lock():
        lan = netns.Lan(
            HOSTS, prefix=f"stnt{os.getpid()}", subnet=netns.free_subnet(), local_host="co"
        ).open()
    servers = [
        subprocess.Popen(
            [*lan.exec_prefix(h), sys.executable, "-c", _SERVE, lan.address(h), str(PORT)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for h in HOSTS
    ]
    for server in servers:
        assert server.stdout.readline() == "listening\n"
    yield lan
    for server in servers:
        server.kill()
        server.communicate()
    lan.close()


def reaches(lan: netns.Lan, a: str, b: str) -> bool:
    argv = [*lan.exec_prefix(a), sys.executable, "-c", _REACH, lan.address(b), str(PORT)]
    said = subprocess.run([*argv, str(CONNECT_TIMEOUT_S)], capture_output=True, text=True)
    return said.stdout.strip() == "hi"


def reachable(lan: netns.Lan) -> set[tuple[str, str]]:
    return {(a, b) for a in HOSTS for b in HOSTS if a != b and reaches(lan, a, b)}


def test_a_severed_pair_is_cut_both_ways_and_only_it(lan: netns.Lan) -> None:
    everyone = {(a, b) for a in HOSTS for b in HOSTS if a != b}
    assert reachable(lan) == everyone  # servers up, the local host's port included

    lan.sever("n1", "co")
    assert reachable(lan) == everyone - {("n1", "co"), ("co", "n1")}
    lan.sever("n1", "n0")
    assert reachable(lan) == {("co", "n0"), ("n0", "co")}

    lan.mend("n1", "co")
    lan.mend("n1", "n0")
    assert reachable(lan) == everyone


def test_a_cut_cable_cuts_the_host_from_everyone_until_it_is_back(lan: netns.Lan) -> None:
    lan.cut("n1")
    assert reachable(lan) == {("co", "n0"), ("n0", "co")}
    lan.reconnect("n1")
    # Back once the hosts that gave up on its address (ARP failed while it was out) ask
    # again: a few connect attempts, not the first one.
    assert any(reaches(lan, "co", "n1") for _ in range(RECONNECT_ATTEMPTS))
    assert any(reaches(lan, "n0", "n1") for _ in range(RECONNECT_ATTEMPTS))


def test_what_a_killed_run_left_is_removed_by_the_next(tmp_path) -> None:
    require_network_namespaces()
    # A run that died before close(): its pid is gone, its namespaces and links are not.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with netns.subnet_lock():
        left = netns.Lan(
            ["co", "n0"], prefix=f"stnk{dead.pid}", subnet=netns.free_subnet(), local_host="co"
        ).open()
    sleeper = subprocess.Popen([*left.exec_prefix("n0"), "sleep", "60"])
    assert f"stnk{dead.pid}-n0" in netns.run("ip", "netns", "list").stdout

    removed = netns.remove_stale("stnk")

    assert sorted(removed) == [f"stnk{dead.pid}-n0", f"stnk{dead.pid}-sw"]
    assert f"stnk{dead.pid}" not in netns.run("ip", "netns", "list").stdout
    assert sleeper.wait(10) == -9  # what ran inside is killed
    # A live run's namespaces are left alone.
    mine = netns.Lan(["n0"], prefix=f"stnk{os.getpid()}", subnet=netns.free_subnet()).open()
    try:
        assert netns.remove_stale("stnk") == []
    finally:
        mine.close()
